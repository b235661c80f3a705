-- Clear outbox entries. KEYS: the dispatch sorted set, then one job hash per acknowledgement;
-- ARGV: id, token per job. One call clears a whole batch; no version bump (see
-- JobStore._ack_dispatch). Returns 1 or 0 per job.
local done = {}
for i = 2, #KEYS do
  local id, token = ARGV[2 * i - 3], ARGV[2 * i - 2]
  local current = redis.call('HMGET', KEYS[i], 'token', 'dispatch_due')
  if current[1] == token and current[2] and current[2] ~= '' then
    redis.call('HSET', KEYS[i], 'dispatch_due', '')
    redis.call('ZREM', KEYS[1], id)
    done[#done + 1] = 1
  else
    done[#done + 1] = 0
  end
end
return done
