-- Delete a meta value if it still holds the value read (a directive taken at least once: see
-- MetaArea.take_directive). KEYS: the meta hash; ARGV: the field, the value expected. Returns 1
-- if deleted, 0 if the field holds something else or nothing.
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
return 1
