-- Shared by the scripts that write a job record: loaded in front of each of them.
--
-- Each script writes the job's hash last, after its indexes (and the message, for
-- insert_push): every command before it can fail only on a corrupted keyspace or an ACL that
-- refuses a key, and then the hash (whose nonce and origin say that a write was done) is not
-- written, so a write is never taken for done when it was cut half way.
--
-- A record's arguments, from ARGV[at]: id, version, data, state, then the record fields
-- below (the Redis store checks that they are its own when it loads this file), then one
-- deadline per clock ('' for none), in the order of the clocks' sorted sets.
local RECORD_FIELDS = {'token', 'worker_id', 'heartbeat_at', 'extended_at', 'dispatch_due', 'promote_at', 'dead_letter', 'nonce', 'origin'}
local FIRST_DEADLINE = 4 + #RECORD_FIELDS

-- The value of record field `name` in the record's arguments from ARGV[at].
local function record_arg(name, at)
  for i, field in ipairs(RECORD_FIELDS) do
    if field == name then return ARGV[at + 3 + i] end
  end
end

-- The 'indexed' field of the record from ARGV[at] written as `version`: the version, ':', the
-- clocks' fingerprint (CLOCKS_ID, put in front of this file by the Redis store: it changes with
-- the list of clocks), ':', then one '1' or '0' per clock (in the order of the clocks' sorted
-- sets) saying whether the id is in that clock's set. A later write then takes the id out of
-- only the sets that hold it.
local function indexed_field(clocks, at, version)
  local mask = {}
  for i = 1, clocks do
    mask[i] = ARGV[at + FIRST_DEADLINE + i - 1] ~= '' and '1' or '0'
  end
  return version .. ':' .. CLOCKS_ID .. ':' .. table.concat(mask)
end

-- The sets that hold the id of a record whose hash has `version` and `indexed`, as a mask for
-- index_record; nil (every set) when the field is missing, was not written with that version
-- (a record last written by an older ojs_celery, which did not keep it) or names another list
-- of clocks.
local function indexed_mask(version, indexed)
  if not indexed then return nil end
  local tag, clocks, mask = string.match(indexed, '^(%d+):(%w+):(%d*)$')
  if tag ~= version or clocks ~= CLOCKS_ID then return nil end
  return mask
end

-- HSET the record's data, state, fields and `indexed` (see indexed_field) into `key`, with
-- 'version' when given.
local function write_record(key, at, version, indexed)
  local args = {'data', ARGV[at + 2], 'state', ARGV[at + 3], 'indexed', indexed}
  if version then
    args[#args + 1] = 'version'
    args[#args + 1] = version
  end
  for i, name in ipairs(RECORD_FIELDS) do
    args[#args + 1] = name
    args[#args + 1] = ARGV[at + 3 + i]
  end
  redis.call('HSET', key, unpack(args))
end

-- Put the record's id into each clock's sorted set KEYS[first_zset..] scored by its deadline,
-- then take it out of the sets of the clocks it has no deadline on that `was` says hold it
-- (`was`: the previous mask, see indexed_mask; '' for a new record; nil: every set). The ZADDs
-- come first: under maxmemory Redis refuses a script's first write that may grow memory, but
-- not the writes after one that changed something (a ZREM), which it cannot undo.
local function index_record(first_zset, clocks, at, was)
  local id = ARGV[at]
  for i = 0, clocks - 1 do
    local deadline = ARGV[at + FIRST_DEADLINE + i]
    if deadline ~= '' then
      redis.call('ZADD', KEYS[first_zset + i], deadline, id)
    end
  end
  if was == '' then return end
  for i = 0, clocks - 1 do
    local held = was == nil or string.sub(was, i + 1, i + 1) == '1'
    if held and ARGV[at + FIRST_DEADLINE + i] == '' then
      redis.call('ZREM', KEYS[first_zset + i], id)
    end
  end
end

-- What an insert of the record from ARGV[1] into KEYS[1] finds before writing: nil when the
-- hash is free, 1 when this very insert was written already (sent again after its reply was
-- lost, it finds its own origin), 0 when another job has the id.
local function earlier_insert()
  if redis.call('EXISTS', KEYS[1]) == 0 then return nil end
  if redis.call('HGET', KEYS[1], 'origin') == record_arg('origin', 1) then return 1 end
  return 0
end
