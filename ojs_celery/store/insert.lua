-- Insert a new job. KEYS: the job hash, then every clock's sorted set; ARGV: one record
-- (see record.lua). Returns 1 if inserted (or inserted already: the same insert sent again
-- after its reply was lost finds its own origin), 0 if another job has the id.
local found = earlier_insert()
if found then return found end
index_record(2, #KEYS - 1, 1, '')
write_record(KEYS[1], 1, '1', indexed_field(#KEYS - 1, 1, '1'))
return 1
