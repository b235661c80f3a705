-- Read and delete a meta value at once (one-shot directives). KEYS: the meta hash;
-- ARGV: the field. Returns the value or nil.
local value = redis.call('HGET', KEYS[1], ARGV[1])
if value then redis.call('HDEL', KEYS[1], ARGV[1]) end
return value
