-- Compare-and-set. KEYS: the job hash, then every clock's sorted set; ARGV: the new record
-- (see record.lua) whose version field is the version it replaces, then the nonce of the
-- record it replaces. Returns 1 if written (or written already: the same write sent again
-- after its reply was lost finds its own nonce), 0 if the record is not the one it replaces.
local current = redis.call('HMGET', KEYS[1], 'version', 'nonce', 'indexed')
if current[2] and current[2] == record_arg('nonce', 1) then return 1 end
if current[1] ~= ARGV[2] or (current[2] or '') ~= ARGV[#ARGV] then return 0 end
local version = tostring(tonumber(current[1]) + 1)
index_record(2, #KEYS - 1, 1, indexed_mask(current[1], current[3]))
write_record(KEYS[1], 1, version, indexed_field(#KEYS - 1, 1, version))
return 1
