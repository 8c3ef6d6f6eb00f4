-- Shared preamble, prepended to every script. The stored formats are described in keys.py.
-- Numbers sent to redis.call go as strings ('1', not 1) where they are constants: Redis
-- formats a Lua number argument with snprintf('%.17g'), some 1,500 instructions each.

-- The caller's time when it sent one (ARGV "now" not empty), else the server's clock:
-- one clock for every worker, whatever their own clocks say.
local function now_ms(sent)
  if sent ~= '' then
    return tonumber(sent)
  end
  local t = redis.call('TIME')
  local us = tonumber(t[2])
  return tonumber(t[1]) * 1000 + (us - us % 1000) / 1000 -- (math.floor: a call, dearer)
end

local function fmt(n)
  return string.format('%.0f', n)
end

-- Numbers are stored in base 36 (an epoch in ms takes 8 characters instead of 13); exact
-- below 2^53, like every number a script handles. Up to 8 digits (36^8 ms: past 2059) are
-- made by one string.char call: a call or a string a digit (or a pair) cost twice the time,
-- and the numbers of an entry were the largest part of a claim's script time
-- (bench/scripts.py --callgrind). '0'..'9' are bytes 48..57, 'a'..'z' 97..122.
local function b36(n)
  if n < 0 then
    return '-' .. b36(-n)
  end
  n = n - n % 1 -- math.floor(n) without a call
  local a = n % 36
  n = (n - a) / 36
  a = a + (a < 10 and 48 or 87)
  if n == 0 then
    return string.char(a)
  end
  local b = n % 36
  n = (n - b) / 36
  b = b + (b < 10 and 48 or 87)
  if n == 0 then
    return string.char(b, a)
  end
  local c = n % 36
  n = (n - c) / 36
  c = c + (c < 10 and 48 or 87)
  if n == 0 then
    return string.char(c, b, a)
  end
  local d = n % 36
  n = (n - d) / 36
  d = d + (d < 10 and 48 or 87)
  if n == 0 then
    return string.char(d, c, b, a)
  end
  local e = n % 36
  n = (n - e) / 36
  e = e + (e < 10 and 48 or 87)
  if n == 0 then
    return string.char(e, d, c, b, a)
  end
  local f = n % 36
  n = (n - f) / 36
  f = f + (f < 10 and 48 or 87)
  if n == 0 then
    return string.char(f, e, d, c, b, a)
  end
  local g = n % 36
  n = (n - g) / 36
  g = g + (g < 10 and 48 or 87)
  if n == 0 then
    return string.char(g, f, e, d, c, b, a)
  end
  local h = n % 36
  n = (n - h) / 36
  h = h + (h < 10 and 48 or 87)
  local low = string.char(h, g, f, e, d, c, b, a)
  if n == 0 then
    return low
  end
  return b36(n) .. low
end

local function n36(text)
  if string.byte(text, 1) == 45 then -- '-'
    return -tonumber(string.sub(text, 2), 36)
  end
  return tonumber(text, 36)
end

-- --- owners: a worker's part of an owner string is written once per queue, not per claim ---
-- An owner "head/tail" is split after its last '/' or '.': the head (a worker process,
-- "hostname/pid/nonce.") is interned in the owners hash under a small id; an entry keeps only
-- the id and the tail (the delivery's counter). Each entry holding an id is one reference, so
-- the head goes when the last entry naming it goes. Owners hash fields: 'h'..head -> id,
-- 'i'..id -> head, 'r'..id -> references, '#' -> the last id given. Id '0' is the empty head.

local function split_owner(owner)
  local head, tail = string.match(owner, '^(.*[/.])(.*)$')
  if head == nil then
    return '', owner
  end
  return head, tail
end

-- A reference to the owner's head; returns the head's id and the owner's tail.
local function owner_ref(owners_key, owner)
  local head, tail = split_owner(owner)
  if head == '' then
    return '0', tail
  end
  local id = redis.call('HGET', owners_key, 'h' .. head)
  if not id then
    id = b36(redis.call('HINCRBY', owners_key, '#', '1'))
    redis.call('HSET', owners_key, 'h' .. head, id, 'i' .. id, head)
  end
  redis.call('HINCRBY', owners_key, 'r' .. id, '1')
  return id, tail
end

-- Drop one reference to head id (nil: an entry of the earlier format, which holds none).
local function owner_unref(owners_key, id)
  if id == nil or id == '0' then
    return
  end
  if redis.call('HINCRBY', owners_key, 'r' .. id, '-1') <= 0 then
    local head = redis.call('HGET', owners_key, 'i' .. id)
    redis.call('HDEL', owners_key, 'r' .. id, 'i' .. id)
    if head then
      redis.call('HDEL', owners_key, 'h' .. head)
    end
  end
end

-- The full owner string of a parsed entry or record (resolved once, then kept on it). A head
-- that cannot be found (never expected) reads as '?', which no owner's head is, so the entry
-- matches no token: fail closed.
local function owner_of(owners_key, item)
  if item.owner == nil then
    local head = ''
    if item.oid ~= '0' then
      head = redis.call('HGET', owners_key, 'i' .. item.oid) or '?'
    end
    item.owner = head .. item.tail
  end
  return item.owner
end

-- An entry or record of the earlier format names its owner in full: intern it before it is
-- written again in the compact format.
local function own(owners_key, item)
  if item.oid == nil then
    item.oid, item.tail = owner_ref(owners_key, item.owner)
  end
end

-- --- claim entries: "instance,created_at,lease,takeovers,owner id,owner tail" --------------
-- (base 36; lease = expires_at - created_at; takeovers = the task's counted takeovers so far,
-- counted only with a takeover limit, followed by '?' while the claim is a takeover whose
-- holder has not marked its start: see claim.lua). The earlier format
-- "instance:created_at:expires_at:owner" (decimal, full owner) is still read; its takeover
-- count, kept in another hash, is not.

local function parse_entry(raw)
  local i, c, l, t, u, o, tail = string.match(
    raw, '^(%w+),(%-?%w+),(%w+),(%w+)(%??),(%w+),(.*)$')
  if i then
    -- (only the created time can be negative: the others need no n36)
    local created = n36(c)
    return {instance = tonumber(i, 36), created = created, expires = created + tonumber(l, 36),
            takeovers = tonumber(t, 36), unstarted = u == '?', oid = o, tail = tail}
  end
  local li, lc, le, lo = string.match(raw, '^(%d+):(%d+):(%d+):(.*)$')
  return {instance = tonumber(li), created = tonumber(lc), expires = tonumber(le),
          takeovers = 0, unstarted = false, owner = lo}
end

-- (the fields as arguments, as parse_entry names them: a claim makes no table to write one)
local function format_entry(instance, created, expires, takeovers, unstarted, oid, tail)
  local counted = '0' -- (most entries': no b36 call)
  if takeovers ~= 0 then
    counted = b36(takeovers)
  end
  if unstarted then
    counted = counted .. '?'
  end
  return b36(instance) .. ',' .. b36(created) .. ',' .. b36(expires - created) .. ',' .. counted
    .. ',' .. oid .. ',' .. tail
end

-- The part of an entry a release reads (instance, owner id and tail; an entry of the earlier
-- format: parse_entry's whole): parse_entry's very pattern, three captures of seven, no times.
local function parse_holder(raw)
  local i, o, tail = string.match(raw, '^(%w+),%-?%w+,%w+,%w+%??,(%w+),(.*)$')
  if i then
    return {instance = tonumber(i, 36), oid = o, tail = tail}
  end
  return parse_entry(raw)
end

-- --- completion records: "instance,done_at,retention,owner id,owner tail" (done, 7) or ------
-- "0,given_up_at,retention,takeovers,owner id,owner tail" (given up as poison, 8: instance 0
-- is never issued); retention = until - done_at. The earlier formats
-- "instance:done_at:until:owner" and "0:given_up_at:until:takeovers:owner" are still read.
-- A parsed record: kind (7 or 8), number (instance or takeovers), at, until_ms, owner.

local function parse_record(raw)
  local i, a, u, rest = string.match(raw, '^(%w+),(%-?%w+),(%w+),(.*)$')
  if i then
    local at = n36(a)
    local r = {at = at, until_ms = at + tonumber(u, 36)}
    if i == '0' then
      local t, o, tail = string.match(rest, '^(%w+),(%w+),(.*)$')
      r.kind, r.number, r.oid, r.tail = 8, tonumber(t, 36), o, tail
    else
      local o, tail = string.match(rest, '^(%w+),(.*)$')
      r.kind, r.number, r.oid, r.tail = 7, tonumber(i, 36), o, tail
    end
    return r
  end
  local li, la, lu, lrest = string.match(raw, '^(%d+):(%d+):(%d+):(.*)$')
  local r = {at = tonumber(la), until_ms = tonumber(lu)}
  if li == '0' then
    local t, owner = string.match(lrest, '^(%d+):(.*)$')
    r.kind, r.number, r.owner = 8, tonumber(t), owner
  else
    r.kind, r.number, r.owner = 7, tonumber(li), lrest
  end
  return r
end

-- (the fields as arguments, not a table: a table made for each record cost more than its use)
local function format_record(kind, number, at, until_ms, oid, tail)
  if kind == 8 then
    return '0,' .. b36(at) .. ',' .. b36(until_ms - at) .. ',' .. b36(number) .. ',' .. oid .. ','
      .. tail
  end
  return b36(number) .. ',' .. b36(at) .. ',' .. b36(until_ms - at) .. ',' .. oid .. ',' .. tail
end

-- Write a task's record (raw: format_record's); the record it replaces (past its retention,
-- not yet purged) gives back its owner reference. The new record brings a reference of its own.
local function put_record(records_key, owners_key, task, raw)
  local old = redis.call('HGET', records_key, task)
  if old then
    owner_unref(owners_key, parse_record(old).oid)
  end
  redis.call('HSET', records_key, task, raw)
end

-- A completion kept for no time still replaces the task's earlier record: there is none after.
local function drop_record(records_key, owners_key, task)
  local old = redis.call('HGET', records_key, task)
  if old then
    owner_unref(owners_key, parse_record(old).oid)
    redis.call('HDEL', records_key, task)
  end
end

-- --- keyed claims: an entry held on a business key names the attempt that holds it ---------
-- A keyed claim's field is the key's (worker/keyed.py), and its owner ends with
-- "~k<task key>~<key retention ms>" (the task key with '%', '~', '.', '/' percent-escaped, so
-- the owner's head stays the worker process's). Its completion record goes to the task key's
-- own field (so a copy of that attempt is skipped as done, not the key's later tasks), and
-- with a key retention also to the key's field (an idempotency key). Returns the task key
-- and the retention, or nil for a plain owner.
local function keyed_owner(owner)
  if not string.find(owner, '~k', 1, true) then
    return nil, 0 -- most owners: one plain search instead of a pattern tried at each byte
  end
  local escaped, ttl = string.match(owner, '~k([^~]*)~(%d+)$')
  if escaped == nil then
    return nil, 0
  end
  local task_key = string.gsub(escaped, '%%(%x%x)', function(h)
    return string.char(tonumber(h, 16))
  end)
  return task_key, tonumber(ttl)
end

-- The field a token's completion record is kept under: the attempt's own for a keyed claim.
local function record_field(task, owner)
  local task_key = keyed_owner(owner)
  return task_key or task
end

-- The claim a token refers to, checked in the Rust AtomicClaimManager's order: not found (4), then another
-- instance (5: stale), then another owner (6). Returns status 1 and the parsed entry when the
-- token holds the claim (parsed by parse, default parse_entry). Expiry is not checked (release
-- and extend ignore it).
local function check_token(claims_key, owners_key, task, owner, instance, parse)
  local raw = redis.call('HGET', claims_key, task)
  if not raw then
    return 4
  end
  local e = (parse or parse_entry)(raw)
  if e.instance ~= tonumber(instance) then
    return 5
  end
  if owner_of(owners_key, e) ~= owner then
    return 6
  end
  return 1, e
end

-- Release the claim a token holds (the Rust AtomicClaimManager's release); with a record TTL, keep a
-- completion record too. k = the queue's {claims, stats, records, owners} keys (release.lua's
-- KEYS[1..4]). Returns 1 (released) or check_token's refusal.
local function release_claim(k, task, owner, instance, record_ttl, now_arg)
  local status, e = check_token(k[1], k[4], task, owner, instance, parse_holder)
  if status ~= 1 then
    return status
  end
  redis.call('HDEL', k[1], task)
  redis.call('HINCRBY', k[2], 'acks', '1')
  local ttl = 0
  if record_ttl ~= '' then
    ttl = tonumber(record_ttl)
  end
  if ttl > 0 then
    local now = now_ms(now_arg)
    -- records expire like claims (judged by the same clock, purged by cleanup), not by a
    -- key TTL, which runs on the server's real time even when the caller sends its own
    -- clock; the claim's owner reference passes to the record
    own(k[4], e)
    local task_key, key_ttl = keyed_owner(owner)
    put_record(k[3], k[4], task_key or task, format_record(7, e.instance, now, now + ttl, e.oid,
      e.tail))
    if key_ttl > 0 then
      -- the key's own record holds a reference of its own to the owner's head
      if e.oid ~= '0' then
        redis.call('HINCRBY', k[4], 'r' .. e.oid, '1')
      end
      put_record(k[3], k[4], task, format_record(7, e.instance, now, now + key_ttl, e.oid,
        e.tail))
    end
  else
    if record_ttl ~= '' then
      -- a completion with no retention: the task keeps no record, not even an earlier one
      drop_record(k[3], k[4], keyed_owner(owner) or task)
    end
    owner_unref(k[4], e.oid)
  end
  return 1
end

-- --- rates: the generic cell rate algorithm without burst (rates/memory.py is the spec) -----
-- A rate key holds its limit's theoretical time of the next start (TAT), "ms" or
-- "ms:remainder:count" (decimal; the remainder in 1/count ms, 0 < remainder < count). A start
-- at now is allowed when ms <= now. A key lives until its ms has passed: after that it says
-- no more than its absence. The functions take the offsets of their keys and rates in KEYS
-- and ARGV, so a claim script can check and count a start's rates next to its own keys.

local function rate_read(key)
  local raw = redis.call('GET', key)
  if not raw then
    return nil
  end
  local ms, rem, count = string.match(raw, '^(%d+):(%d+):(%d+)$')
  if ms then
    return {ms = tonumber(ms), rem = tonumber(rem), count = tonumber(count)}
  end
  return {ms = tonumber(raw), rem = 0, count = 1}
end

-- The longest wait in ms of the n limits whose keys are keys[k0 + 1 .. k0 + n] (0: each
-- allows a start at now), the index (1..n) of the first limit waiting it, and their states.
-- Writes nothing: a refused start costs no limit anything.
local function rate_check(keys, k0, n, now)
  local states, wait, index = {}, 0, 0
  for i = 1, n do
    local s = rate_read(keys[k0 + i])
    states[i] = s
    if s and s.ms - now > wait then
      wait, index = s.ms - now, i
    end
  end
  return wait, index, states
end

-- Count a start at now against the n limits rate_check allowed: each TAT moves one interval
-- (period / count, exactly: whole ms and a remainder in 1/count ms) past max(TAT, now).
-- argv[a0 + 2i - 1] and argv[a0 + 2i] are limit i's count and period in ms; pad is added to
-- each key's TTL. Returns each limit's next ms.
local function rate_commit(keys, k0, argv, a0, states, n, now, pad)
  local nexts = {}
  for i = 1, n do
    local count = tonumber(argv[a0 + 2 * i - 1])
    local period = tonumber(argv[a0 + 2 * i])
    local s = states[i]
    local ms, rem = now, 0
    if s and s.ms >= now then
      -- a start as soon as allowed is placed at the TAT itself: no fraction is lost
      ms, rem = s.ms, s.rem
      if s.count ~= count then
        -- the rate changed: the remainder in the new count's units, rounded up (never earlier)
        rem = math.ceil(rem * count / s.count)
      end
    end
    local fraction = period % count
    ms, rem = ms + (period - fraction) / count, rem + fraction
    local carry = math.floor(rem / count)
    ms, rem = ms + carry, rem - carry * count
    local value = fmt(ms)
    if rem > 0 then
      value = value .. ':' .. fmt(rem) .. ':' .. fmt(count)
    end
    redis.call('SET', keys[k0 + i], value, 'PX', fmt(ms - now + 1 + pad))
    nexts[i] = ms
  end
  return nexts
end
