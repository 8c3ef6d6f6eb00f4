-- Claim candidates for a lane: recount, then compare-and-swap each in order until full.
-- KEYS[1]          = task records hash of the lane               (P:lane:{L}:tasks)
-- KEYS[2..n+1]     = due sorted set of each lane kind            (P:lane:{L}:due:<kind>)
-- KEYS[n+2..2n+1]  = processing sorted set of each lane kind     (P:lane:{L}:processing:<kind>)
-- ARGV[1] = claimed_at, epoch microseconds
-- ARGV[2] = lease_expires_at, epoch microseconds
-- ARGV[3] = the lane's limit
-- ARGV[4] = n, the number of lane kinds
-- ARGV[5..4+n] = the lane kinds, in the order of their keys
-- ARGV[5+n..]  = per candidate: member, expected token, next token
-- returns: {0, position, kind number, ...}  OK, then per claimed candidate its 1-based
--          position and the 1-based number of its kind in ARGV[5..4+n], in claim order
--          {2, position}       NOT_FOUND: that candidate is no task of the lane; nothing changed
local claimed_at, lease = ARGV[1], ARGV[2]
local now = tonumber(claimed_at)
local n = tonumber(ARGV[4])
local first = 5 + n
local count = (#ARGV - first + 1) / 3

local slot = {}
for i = 1, n do
  slot[ARGV[4 + i]] = i
end

-- Check every candidate before the first write, so a bad batch changes nothing.
local records = {}
for c = 1, count do
  local member = ARGV[first + (c - 1) * 3]
  if records[member] == nil then
    local raw = redis.call('HGET', KEYS[1], member)
    if not raw then
      return {NOT_FOUND, c}
    end
    local record = cjson.decode(raw)
    if not slot[record.kind] then
      return {NOT_FOUND, c}
    end
    records[member] = record
  end
end

-- Recount at claimed_at: leases that expired since the caller counted free their slots.
local active = 0
for i = 1, n do
  active = active + redis.call('ZCOUNT', KEYS[1 + n + i], '(' .. claimed_at, '+inf')
end
local available = tonumber(ARGV[3]) - active

local out = {OK}
local taken = 0
for c = 1, count do
  if taken >= available then
    break
  end
  local base = first + (c - 1) * 3
  local member, expected, following = ARGV[base], ARGV[base + 1], ARGV[base + 2]
  local record = records[member]
  local claimable = false
  if record.status == 'pending' or record.status == 'retry' then
    claimable = tonumber(record.next_run_at_us) <= now
  elseif record.status == 'processing' then
    claimable = record.lease_expires_at_us == '' or tonumber(record.lease_expires_at_us) <= now
  end
  -- Tokens are compared as decimal strings: Lua numbers cannot hold 64-bit tokens exactly.
  if claimable and record.token == expected then
    local k = slot[record.kind]
    if record.status == 'processing' then
      redis.call('ZREM', KEYS[1 + n + k], member)
    else
      redis.call('ZREM', KEYS[1 + k], member)
    end
    record.status = 'processing'
    record.token = following
    record.lease_expires_at_us = lease
    record.claimed_at_us = claimed_at
    redis.call('HSET', KEYS[1], member, cjson.encode(record))
    redis.call('ZADD', KEYS[1 + n + k], lease, member)
    taken = taken + 1
    out[#out + 1] = c
    out[#out + 1] = k
  end
end
return out
