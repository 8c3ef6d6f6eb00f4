-- Claim a task: the original's claim, optionally refusing a task with a completion record and
-- giving a task up once its claim has been taken over too often (a poison task).
-- KEYS[1] = claims hash of the queue        ({q}:c)  task -> entry
-- KEYS[2] = expiry sorted set of the queue  ({q}:e)  task -> expires_at
-- KEYS[3] = instance counter of the queue   ({q}:n)
-- KEYS[4] = stats hash of the queue         ({q}:s)
-- KEYS[5] = completion records of the queue ({q}:d)  task -> record (see parse_record)
-- KEYS[6] = takeover counts of the queue    ({q}:t)  task -> takeovers so far
-- KEYS[7] = retention sorted set of records ({q}:x)  task -> until
-- ARGV[1] = task id
-- ARGV[2] = owner
-- ARGV[3] = lease in ms
-- ARGV[4] = now in epoch ms, or '' for the server clock
-- ARGV[5] = '1': answer DONE / GIVEN_UP when a live record exists; '0': ignore records
-- ARGV[6] = the most takeovers granted to the task, or '' for no limit (and no counting)
-- ARGV[7] = how long a given-up record is kept, in ms (read only when giving up)
-- returns: {1 SUCCESS | 3 TOOK_OVER, instance, created_at, expires_at, previous owner or ''}
--          {2 ALREADY_CLAIMED, holder, expires_at}
--          {7 DONE, instance, done_at, owner}
--          {8 GIVEN_UP, takeovers, given_up_at, previous owner}
local now = now_ms(ARGV[4])
-- attempts are counted first, whatever the outcome (the original's order)
redis.call('HINCRBY', KEYS[4], 'attempts', 1)

if ARGV[5] == '1' then
  local record = redis.call('HGET', KEYS[5], ARGV[1])
  if record then
    local status, number, at, until_ms, owner = parse_record(record)
    if now < until_ms then
      return {status, number, at, owner}
    end
  end
end

local previous = ''
local entry = redis.call('HGET', KEYS[1], ARGV[1])
if entry then
  local _, _, expires, owner = parse_entry(entry)
  -- the same owner re-claims whether expired or not; only another owner is judged by expiry
  if owner ~= ARGV[2] then
    if now < expires then
      redis.call('HINCRBY', KEYS[4], 'contentions', 1)
      return {2, owner, expires}
    end
    previous = owner
  end
end

if previous ~= '' and ARGV[6] ~= '' then
  local taken = tonumber(redis.call('HGET', KEYS[6], ARGV[1]) or '0')
  if taken >= tonumber(ARGV[6]) then
    -- one takeover too many: nobody gets the claim; the expired entry and the count give
    -- way to a given-up record, which answers every later copy like a completion record
    redis.call('HDEL', KEYS[1], ARGV[1])
    redis.call('ZREM', KEYS[2], ARGV[1])
    redis.call('HDEL', KEYS[6], ARGV[1])
    local ttl = tonumber(ARGV[7])
    if ttl > 0 then
      local record = '0:' .. fmt(now) .. ':' .. fmt(now + ttl) .. ':' .. fmt(taken) .. ':' .. previous
      redis.call('HSET', KEYS[5], ARGV[1], record)
      redis.call('ZADD', KEYS[7], fmt(now + ttl), ARGV[1])
    end
    return {8, taken, now, previous}
  end
  redis.call('HINCRBY', KEYS[6], ARGV[1], 1)
end

local instance = redis.call('INCR', KEYS[3])
local expires = now + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], format_entry(fmt(instance), now, expires, ARGV[2]))
redis.call('ZADD', KEYS[2], fmt(expires), ARGV[1])
if previous ~= '' then
  redis.call('HINCRBY', KEYS[4], 'takeovers', 1)
  return {3, instance, now, expires, previous}
end
redis.call('HINCRBY', KEYS[4], 'successes', 1)
return {1, instance, now, expires, ''}
