-- Remove a worker's record. KEYS: the worker's hash, the workers' sorted set, the removal's
-- mark; ARGV: the worker id, the removal's nonce, the seconds the mark is kept, the score of a
-- tombstone if only a tombstone may be removed (the end of a burial: not the record of a
-- worker that came back), else ''. Returns 1 if removed (or removed already by this very call:
-- sent again by redis-py after its reply was lost, it finds its own mark), 0 if there was no
-- record (another sweeper removed it) or, with ARGV[4], no tombstone.
if ARGV[4] ~= '' then
  local score = redis.call('ZSCORE', KEYS[2], ARGV[1])
  if score and tonumber(score) ~= tonumber(ARGV[4]) then return 0 end
end
redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('DEL', KEYS[1])
  redis.call('SET', KEYS[3], ARGV[2], 'EX', ARGV[3])
  return 1
end
if redis.call('GET', KEYS[3]) == ARGV[2] then return 1 end
return 0
