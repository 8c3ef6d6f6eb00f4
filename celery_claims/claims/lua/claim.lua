-- Claim a task: the Rust AtomicClaimManager's claim, optionally refusing a task with a completion record and
-- giving a task up once its claim has been taken over too often (a poison task).
-- KEYS[1] = claims hash of the queue        ({q}:c)  task -> entry (see parse_entry)
-- KEYS[2] = instance counter of the queue   ({q}:n)
-- KEYS[3] = stats hash of the queue         ({q}:s)
-- KEYS[4] = completion records of the queue ({q}:d)  task -> record (see parse_record)
-- KEYS[5] = owners hash of the queue        ({q}:o)  (see owner_ref)
-- ARGV[1] = task id
-- ARGV[2] = owner (a keyed claim's names the attempt: see keyed_owner)
-- ARGV[3] = lease in ms
-- ARGV[4] = now in epoch ms, or '' for the server clock
-- ARGV[5] = '1': answer DONE / GIVEN_UP when a live record exists; '0': ignore records;
--           'r<run>' (base 36): as '1', but a completion record of an earlier run (its owner
--           ends with '~r<a lower run>') is not answered: the claim is made as if there were
--           none, a new run of the task (celery_claims/runs.py)
-- ARGV[6] = the most takeovers granted to the task, or '' for no limit (and no counting).
--           Counted: the takeover of the task's first claim, and of a takeover's claim whose
--           holder marked its start (mark_started.lua); a holder that died between its
--           takeover and its start (a worker killed with the task still in its prefetch) is
--           not, so an innocent task is never given up for its holders' deaths alone.
-- ARGV[7] = how long a given-up record is kept, in ms (read only when giving up)
-- returns: {1 SUCCESS | 3 TOOK_OVER, instance, created_at, expires_at, previous owner or ''}
--          {2 ALREADY_CLAIMED, holder, expires_at}
--          {7 DONE, instance, done_at, owner}
--          {8 GIVEN_UP, takeovers, given_up_at, previous owner}
local now = now_ms(ARGV[4])
-- attempts are counted first, whatever the outcome (the Rust AtomicClaimManager's order)
redis.call('HINCRBY', KEYS[3], 'attempts', '1')

if ARGV[5] ~= '0' then
  local run = nil
  if ARGV[5] ~= '1' and string.byte(ARGV[5], 1) == 114 then -- 'r' (a call: not for '1')
    run = n36(string.sub(ARGV[5], 2))
  end
  -- a keyed claim (ARGV[1] a key, the owner naming its attempt): the attempt's own record
  -- first (a copy of a finished attempt), then the key's (a key kept done for a while)
  local field = keyed_owner(ARGV[2]) or ARGV[1]
  while field do
    local raw = redis.call('HGET', KEYS[4], field)
    if raw then
      local r = parse_record(raw)
      if now < r.until_ms then
        local owner = owner_of(KEYS[5], r)
        local recorded = r.kind == 7 and string.match(owner, '~r(%w+)$')
        -- a record of an earlier run keeps its place (a copy of that run still finds it)
        -- until this claim's own completion replaces it
        if not (run and recorded and n36(recorded) < run) then
          return {r.kind, r.number, r.at, owner}
        end
      end
    end
    field = field ~= ARGV[1] and ARGV[1] or nil -- (no table of fields to walk: its cost)
  end
end

local previous = ''
local e = nil
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if raw then
  e = parse_entry(raw)
  local holder = owner_of(KEYS[5], e)
  -- the same owner re-claims whether expired or not; only another owner is judged by expiry
  if holder ~= ARGV[2] then
    if now < e.expires then
      redis.call('HINCRBY', KEYS[3], 'contentions', '1')
      return {2, holder, e.expires}
    end
    previous = holder
  end
end

-- the task's takeovers so far live in its entry: they go when the entry goes
local takeovers = 0
local unstarted = false
if e then
  takeovers = e.takeovers
  -- the same owner re-claiming keeps its mark; another owner's claim starts unmarked
  unstarted = previous == '' and e.unstarted
end
if previous ~= '' and ARGV[6] ~= '' then
  -- the new holder's claim counts once its start is marked
  unstarted = true
  if e.unstarted then
    -- the expired holder never started the task: its death is not the task's doing
  elseif takeovers >= tonumber(ARGV[6]) then
    -- one takeover too many: nobody gets the claim; the expired entry and its count give
    -- way to a given-up record, which answers every later copy like a completion record
    redis.call('HDEL', KEYS[1], ARGV[1])
    local ttl = tonumber(ARGV[7])
    if ttl > 0 then
      own(KEYS[5], e)
      put_record(KEYS[4], KEYS[5], ARGV[1], format_record(8, takeovers, now, now + ttl, e.oid,
        e.tail))
    else
      owner_unref(KEYS[5], e.oid)
    end
    return {8, takeovers, now, previous}
  else
    takeovers = takeovers + 1
  end
end

local instance = redis.call('INCR', KEYS[2])
local expires = now + tonumber(ARGV[3])
local oid, tail
if e and previous == '' and e.oid then
  -- the same owner re-claims: its entry's reference is reused
  oid, tail = e.oid, e.tail
else
  -- a reference for the new owner first, then the old entry's goes (same worker: no churn)
  oid, tail = owner_ref(KEYS[5], ARGV[2])
  if e then
    owner_unref(KEYS[5], e.oid)
  end
end
redis.call('HSET', KEYS[1], ARGV[1],
  format_entry(instance, now, expires, takeovers, unstarted, oid, tail))
if previous ~= '' then
  redis.call('HINCRBY', KEYS[3], 'takeovers', '1')
  return {3, instance, now, expires, previous}
end
redis.call('HINCRBY', KEYS[3], 'successes', '1')
return {1, instance, now, expires, ''}
