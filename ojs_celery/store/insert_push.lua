-- Insert a new job and push its message onto a broker queue in the same Redis, in one atomic
-- step (see ojs_celery/joint.py). KEYS: the job hash, every clock's sorted set, then the
-- queue's list; ARGV: one record (see record.lua), then the message as kombu pushes it.
-- Returns 1 if done (or done already: sent again after its reply was lost, it finds its own
-- origin and pushes nothing more), 0 if another job has the id (nothing written or pushed).
-- The queue key's type is checked before the first write (kombu's own push would fail on
-- it); the record is written last (see record.lua).
local found = earlier_insert()
if found then return found end
local queue = KEYS[#KEYS]
local kind = redis.call('TYPE', queue)['ok']
if kind ~= 'none' and kind ~= 'list' then
  return redis.error_reply('WRONGTYPE the queue key ' .. queue .. ' holds a ' .. kind)
end
index_record(2, #KEYS - 2, 1, '')
redis.call('LPUSH', queue, ARGV[#ARGV])
write_record(KEYS[1], 1, '1', indexed_field(#KEYS - 2, 1, '1'))
return 1
