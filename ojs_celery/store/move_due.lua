-- Move index entries that a sweep found not due to the deadline their record gives, each only
-- if its score is still the one the sweep read (a write since has set its own). KEYS[1]: the
-- clock's sorted set; ARGV: job id, score read, new score, for each entry. Returns how many
-- moved.
local moved = 0
for i = 1, #ARGV, 3 do
  local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if score and tonumber(score) == tonumber(ARGV[i + 1]) then
    redis.call('ZADD', KEYS[1], ARGV[i + 2], ARGV[i])
    moved = moved + 1
  end
end
return moved
