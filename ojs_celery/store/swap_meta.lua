-- Compare-and-set of a meta value. KEYS: the meta hash; ARGV: the field, the value expected
-- (ignored when ARGV[4] is "1": no value expected), the new value, that flag. Returns 1 if
-- written (or holding the new value already: the same swap sent again by redis-py after its
-- reply was lost), 0 if the field held something else.
local value = redis.call('HGET', KEYS[1], ARGV[1])
if value == ARGV[3] then return 1 end
if ARGV[4] == '1' then
  if value then return 0 end
elseif value ~= ARGV[2] then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
