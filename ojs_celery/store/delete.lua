-- Delete a job (pruning). KEYS: the job hash, then every clock's sorted set; ARGV: id,
-- expected version. Returns 1 if deleted.
if redis.call('HGET', KEYS[1], 'version') ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1])
for i = 2, #KEYS do redis.call('ZREM', KEYS[i], ARGV[1]) end
return 1
