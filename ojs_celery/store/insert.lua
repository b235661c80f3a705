-- Insert a new job. KEYS: the job hash, then every clock's sorted set; ARGV: one record
-- (see record.lua). Returns 0 if the id exists, else 1.
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
write_record(KEYS[1], 1, '1')
index_record(2, #KEYS - 1, 1, false)
return 1
