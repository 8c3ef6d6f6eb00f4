-- List the claimable tasks of some kinds of one lane, most overdue first.
-- KEYS[1]          = task records hash of the lane        (P:lane:{L}:tasks)
-- KEYS[2..n+1]     = due sorted set of each kind          (P:lane:{L}:due:<kind>)
-- KEYS[n+2..2n+1]  = processing sorted set of each kind   (P:lane:{L}:processing:<kind>)
-- ARGV[1] = now, epoch microseconds
-- ARGV[2] = the most tasks to return
-- returns: {member, record, member, record, ...} ordered by (due time, member)
local now, limit = ARGV[1], tonumber(ARGV[2])

-- Due tasks are due by next_run_at, processing tasks by their lease expiry: both are scores,
-- so one range per set finds them, and at most `limit` from each set can make the cut.
local found = {}
for i = 2, #KEYS do
  local rows = redis.call('ZRANGEBYSCORE', KEYS[i], '-inf', now, 'WITHSCORES', 'LIMIT', 0, ARGV[2])
  for j = 1, #rows, 2 do
    found[#found + 1] = {tonumber(rows[j + 1]), rows[j]}
  end
end
table.sort(found, function(a, b)
  if a[1] ~= b[1] then return a[1] < b[1] end
  return a[2] < b[2]
end)

local out = {}
for i = 1, math.min(limit, #found) do
  local record = redis.call('HGET', KEYS[1], found[i][2])
  if record then
    out[#out + 1] = found[i][2]
    out[#out + 1] = record
  end
end
return out
