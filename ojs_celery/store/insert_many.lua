-- Insert new jobs, all of them or none. KEYS: every clock's sorted set, then one job hash per
-- job; ARGV: the number of clocks, then one record per job (see record.lua), back to back.
-- Returns nil when all were written (or written already: the same batch sent again after its
-- reply was lost finds its own origin, and the batch is written whole or not at all), else the
-- id of the first job that exists (nothing written: every check comes before the first write).
local clocks = tonumber(ARGV[1])
local size = FIRST_DEADLINE + clocks
for j = 1, #KEYS - clocks do
  if redis.call('EXISTS', KEYS[clocks + j]) == 1 then
    local at = 2 + (j - 1) * size
    if redis.call('HGET', KEYS[clocks + j], 'origin') == record_arg('origin', at) then
      return false
    end
    return ARGV[at]
  end
end
for j = 1, #KEYS - clocks do
  local at = 2 + (j - 1) * size
  index_record(1, clocks, at, '')
  write_record(KEYS[clocks + j], at, '1', indexed_field(clocks, at, '1'))
end
return false
