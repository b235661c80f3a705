-- Compare-and-set. KEYS: the job hash, then every clock's sorted set; ARGV: the new record
-- (see record.lua) whose version field is the version it replaces. Returns 1 if written.
if redis.call('HGET', KEYS[1], 'version') ~= ARGV[2] then return 0 end
write_record(KEYS[1], 1, nil)
redis.call('HINCRBY', KEYS[1], 'version', 1)
index_record(2, #KEYS - 1, 1, true)
return 1
