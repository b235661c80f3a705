-- Insert a new job. KEYS: the job hash, then every clock's sorted set; ARGV: one record
-- (see record.lua). Returns 1 if inserted (or inserted already: the same insert sent again
-- after its reply was lost finds its own origin), 0 if another job has the id.
if redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('HGET', KEYS[1], 'origin') == record_arg('origin', 1) then return 1 end
  return 0
end
write_record(KEYS[1], 1, '1')
index_record(2, #KEYS - 1, 1, false)
return 1
