-- Purge one batch of a lane's stale records: waiting ones (pending, retry) due before the
-- cutoff and processing ones whose lease expired before it; nobody claimed or renewed them
-- since. Done records are in no sorted set, so they are never read.
-- KEYS[1]          = task records hash of the lane               (P:lane:{L}:tasks)
-- KEYS[2..n+1]     = due sorted set of each lane kind            (P:lane:{L}:due:<kind>)
-- KEYS[n+2..2n+1]  = processing sorted set of each lane kind     (P:lane:{L}:processing:<kind>)
-- ARGV[1] = the cutoff, epoch microseconds (a record idle since before it is stale)
-- ARGV[2] = the most records to purge; at most that many members are read per sorted set
-- returns: {0, member, ...}  OK, then the member of every record purged
local cutoff = tonumber(ARGV[1])
local left = tonumber(ARGV[2])
local n = (#KEYS - 1) / 2
local out = {OK}

-- The score only nominates a record; its JSON, read here inside the script, decides, so a
-- record claimed, retried or renewed since the caller chose the cutoff is never purged.
local function stale(record, processing)
  if processing then
    return record.status == 'processing' and record.lease_expires_at_us ~= ''
      and tonumber(record.lease_expires_at_us) < cutoff
  end
  return (record.status == 'pending' or record.status == 'retry')
    and tonumber(record.next_run_at_us) < cutoff
end

for i = 2, #KEYS do
  if left <= 0 then
    break
  end
  local processing = i > n + 1
  -- a range of the sorted set, never the whole hash: the cost is the batch, not the lane
  local nominated = redis.call('ZRANGEBYSCORE', KEYS[i], '-inf', '(' .. ARGV[1], 'LIMIT', 0, left)
  for _, member in ipairs(nominated) do
    local raw = redis.call('HGET', KEYS[1], member)
    if not raw or stale(cjson.decode(raw), processing) then
      redis.call('HDEL', KEYS[1], member)
      redis.call('ZREM', KEYS[i], member)
      out[#out + 1] = member
      left = left - 1
    end
  end
end
return out
