-- Replace a worker's record with its tombstone, unless it is one already (the claim of its
-- burial among sweepers). KEYS: the worker's hash, the workers' sorted set; ARGV: the worker
-- id, the tombstone's JSON, its burial nonce, the tombstone's score. Returns 1 if replaced (or
-- replaced already by this very call, sent again by redis-py after its reply was lost: the
-- tombstone there carries its nonce), 0 if there is no record or another's tombstone.
local score = redis.call('ZSCORE', KEYS[2], ARGV[1])
if score and tonumber(score) ~= tonumber(ARGV[4]) and redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], 'data', ARGV[2])
  redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
  return 1
end
local data = redis.call('HGET', KEYS[1], 'data')
if data and string.find(data, ARGV[3], 1, true) then return 1 end
return 0
