-- Every worker record in one round trip. KEYS: the workers sorted set; ARGV: the prefix of
-- the worker hashes. Returns their data fields.
local ids = redis.call('ZRANGE', KEYS[1], 0, -1)
local out = {}
for _, id in ipairs(ids) do
  local data = redis.call('HGET', ARGV[1] .. id, 'data')
  if data then out[#out + 1] = data end
end
return out
