-- Take the ids whose job hash does not exist out of a clock's sorted set: a write that failed
-- half way (an error reply on an index key) leaves its index entries, as the record scripts
-- write the hash last. KEYS: the set, then one job hash per id; ARGV: the ids. Returns how
-- many were taken out.
local gone = 0
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then
    gone = gone + redis.call('ZREM', KEYS[1], ARGV[i - 1])
  end
end
return gone
