-- Claim candidates for a lane: recount, then compare-and-swap each in order until full.
-- KEYS[1]          = task records hash of the lane               (P:lane:{L}:tasks)
-- KEYS[2..n+1]     = due sorted set of each lane kind            (P:lane:{L}:due:<kind>)
-- KEYS[n+2..2n+1]  = processing sorted set of each lane kind     (P:lane:{L}:processing:<kind>)
-- ARGV[1] = claimed_at, epoch microseconds
-- ARGV[2] = lease_expires_at, epoch microseconds
-- ARGV[3] = the lane's limit
-- ARGV[4] = the limit per key, or 0: the lane has no per-key limit (keys are not read)
-- ARGV[5] = n, the number of lane kinds
-- ARGV[6..5+n] = the lane kinds, in the order of their keys
-- ARGV[6+n..]  = per candidate: member, expected token, next token, key ('' for none)
-- returns: {0, position, kind number, ...}  OK, then per claimed candidate its 1-based
--          position and the 1-based number of its kind in ARGV[6..5+n], in claim order
--          {2, position}       NOT_FOUND: that candidate is no task of the lane; nothing changed
local claimed_at, lease = ARGV[1], ARGV[2]
local now = tonumber(claimed_at)
local per_key = tonumber(ARGV[4])
local n = tonumber(ARGV[5])
local first = 6 + n
local count = (#ARGV - first + 1) / 4

local slot = {}
for i = 1, n do
  slot[ARGV[5 + i]] = i
end

-- Check every candidate before the first write, so a bad batch changes nothing.
local records = {}
for c = 1, count do
  local member = ARGV[first + (c - 1) * 4]
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
-- A keyed lane also counts its live leases per key, from the records they hold: no per-key
-- state exists beside them, so an idle key costs nothing and an expired lease frees its
-- key's slot at the same instant as its lane slot. (At most `limit` leases are live.)
local active = 0
local running = {}
for i = 1, n do
  if per_key > 0 then
    local live = redis.call('ZRANGEBYSCORE', KEYS[1 + n + i], '(' .. claimed_at, '+inf')
    for _, held in ipairs(live) do
      local key = cjson.decode(redis.call('HGET', KEYS[1], held)).key
      if key then
        running[key] = (running[key] or 0) + 1
      end
    end
    active = active + #live
  else
    active = active + redis.call('ZCOUNT', KEYS[1 + n + i], '(' .. claimed_at, '+inf')
  end
end
local available = tonumber(ARGV[3]) - active

local out = {OK}
local taken = 0
for c = 1, count do
  if taken >= available then
    break
  end
  local base = first + (c - 1) * 4
  local member, expected, following = ARGV[base], ARGV[base + 1], ARGV[base + 2]
  local key = ARGV[base + 3]
  local record = records[member]
  local claimable = false
  if record.status == 'pending' or record.status == 'retry' then
    claimable = tonumber(record.next_run_at_us) <= now
  elseif record.status == 'processing' then
    claimable = record.lease_expires_at_us == '' or tonumber(record.lease_expires_at_us) <= now
  end
  -- Tokens are compared as decimal strings: Lua numbers cannot hold 64-bit tokens exactly.
  -- A candidate whose key is at its limit is skipped like a miss: it uses no lane capacity,
  -- so the next key in the caller's order gets the slot.
  if per_key > 0 and key ~= '' and (running[key] or 0) >= per_key then
    claimable = false
  end
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
    if key ~= '' then
      record.key = key
      running[key] = (running[key] or 0) + 1
    else
      record.key = nil
    end
    redis.call('HSET', KEYS[1], member, cjson.encode(record))
    redis.call('ZADD', KEYS[1 + n + k], lease, member)
    taken = taken + 1
    out[#out + 1] = c
    out[#out + 1] = k
  end
end
return out
