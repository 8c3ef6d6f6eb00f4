-- Shared preamble, prepended to every script.

-- The caller's time when it sent one (ARGV "now" not empty), else the server's clock:
-- one clock for every worker, whatever their own clocks say.
local function now_ms(sent)
  if sent ~= '' then
    return tonumber(sent)
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function fmt(n)
  return string.format('%.0f', n)
end

-- A claim entry is "instance:created_at:expires_at:owner"; the owner goes last, so it may
-- contain ':' itself.
local function format_entry(instance, created, expires, owner)
  return instance .. ':' .. fmt(created) .. ':' .. fmt(expires) .. ':' .. owner
end

local function parse_entry(entry)
  local instance, created, expires, owner = string.match(entry, '^(%d+):(%d+):(%d+):(.*)$')
  return instance, tonumber(created), tonumber(expires), owner
end

-- The claim a token refers to, checked in the original's order: not found (4), then another
-- instance (5: stale), then another owner (6). Returns status 1 and the entry's fields when
-- the token holds the claim. Expiry is not checked (release and extend ignore it).
local function check_token(claims_key, task, owner, instance)
  local entry = redis.call('HGET', claims_key, task)
  if not entry then
    return 4
  end
  local e_instance, created, expires, e_owner = parse_entry(entry)
  if e_instance ~= instance then
    return 5
  end
  if e_owner ~= owner then
    return 6
  end
  return 1, e_instance, created, expires
end

-- A record of the completion hash is "instance:done_at:until:owner" (done, status 7) or
-- "0:given_up_at:until:takeovers:owner" (given up as poison, status 8): instance 0 is never
-- issued, and a reader that knows only the first form still takes it as done (never run).
-- Returns status, instance or takeovers, done_at or given_up_at, until, owner.
local function parse_record(record)
  local instance, at, until_ms, rest = string.match(record, '^(%d+):(%d+):(%d+):(.*)$')
  if instance == '0' then
    local takeovers, owner = string.match(rest, '^(%d+):(.*)$')
    return 8, tonumber(takeovers), tonumber(at), tonumber(until_ms), owner
  end
  return 7, tonumber(instance), tonumber(at), tonumber(until_ms), rest
end

-- Release the claim a token holds (the original's release); with a record TTL, keep a
-- completion record too. k = the queue's {claims, expiries, stats, records, retention,
-- takeovers} keys (release.lua's KEYS[1..6]). Returns 1 (released) or check_token's refusal.
local function release_claim(k, task, owner, instance, record_ttl, now_arg)
  local status, e_instance = check_token(k[1], task, owner, instance)
  if status ~= 1 then
    return status
  end
  redis.call('HDEL', k[1], task)
  redis.call('ZREM', k[2], task)
  -- the task ended under a live owner: it is no poison, and its count must not outlive it
  redis.call('HDEL', k[6], task)
  redis.call('HINCRBY', k[3], 'acks', 1)
  if record_ttl ~= '' then
    local ttl = tonumber(record_ttl)
    if ttl > 0 then
      local now = now_ms(now_arg)
      -- records expire like claims (judged by the same clock, purged by cleanup), not by a
      -- key TTL, which runs on the server's real time even when the caller sends its own
      -- clock; a completion record has the shape of an entry: instance:done_at:until:owner
      redis.call('HSET', k[4], task, format_entry(e_instance, now, now + ttl, owner))
      redis.call('ZADD', k[5], fmt(now + ttl), task)
    end
  end
  return 1
end
