-- Sweep one page of a queue's claims and one page of its completion records: remove the
-- expired claims (counted as expirations, at most a limit) and the records past their
-- retention (not counted: nothing expired). There is no expiry index (it would store every
-- task id a second time), so cleanup walks the hashes with HSCAN, resuming where it stopped.
-- KEYS[1] = claims hash of the queue        ({q}:c)
-- KEYS[2] = stats hash of the queue         ({q}:s)
-- KEYS[3] = completion records of the queue ({q}:d)
-- KEYS[4] = owners hash of the queue        ({q}:o)
-- KEYS[5] = sweep cursors of the queue      ({q}:w)  'c' -> claims cursor, 'd' -> records
-- KEYS[6..8] = the earlier format's index keys ({q}:e, {q}:x, {q}:t): unlinked, unused now
-- ARGV[1] = now in epoch ms, or '' for the server clock
-- ARGV[2] = the most claims to remove
-- ARGV[3] = entries to examine per hash (HSCAN's COUNT: a hint; a small hash comes whole)
-- ARGV[4] = where to read the claims: a cursor, '' for the saved one, '-' not at all
-- ARGV[5] = the same for the records
-- returns: {claims removed, records removed, next claims cursor, next records cursor,
--           claims examined, records examined} (a next cursor '0': that hash is swept through;
--           '-': not read)
local now = now_ms(ARGV[1])
local limit = tonumber(ARGV[2])
local count = tonumber(ARGV[3])

redis.call('UNLINK', KEYS[6], KEYS[7], KEYS[8])

local function start(field, given)
  if given == '' then
    return redis.call('HGET', KEYS[5], field) or '0'
  end
  return given
end

local claims_cursor, removed, examined = start('c', ARGV[4]), 0, 0
if claims_cursor ~= '-' then
  local page = redis.call('HSCAN', KEYS[1], claims_cursor, 'COUNT', count)
  local items, full = page[2], false
  for i = 1, #items, 2 do
    local e = parse_entry(items[i + 1])
    if now >= e.expires then
      if removed >= limit then
        full = true
        break
      end
      redis.call('HDEL', KEYS[1], items[i])
      owner_unref(KEYS[4], e.oid)
      removed = removed + 1
    end
    examined = examined + 1
  end
  -- stopped by the limit inside the page: the next call reads the same page again (what was
  -- removed is gone from it), so no expired claim is passed over
  if not full then
    claims_cursor = page[1]
  end
  redis.call('HSET', KEYS[5], 'c', claims_cursor)
  if removed > 0 then
    redis.call('HINCRBY', KEYS[2], 'expirations', removed)
  end
end

local records_cursor, purged, read = start('d', ARGV[5]), 0, 0
if records_cursor ~= '-' then
  local page = redis.call('HSCAN', KEYS[3], records_cursor, 'COUNT', count)
  local items = page[2]
  for i = 1, #items, 2 do
    local r = parse_record(items[i + 1])
    if now >= r.until_ms then
      redis.call('HDEL', KEYS[3], items[i])
      owner_unref(KEYS[4], r.oid)
      purged = purged + 1
    end
    read = read + 1
  end
  records_cursor = page[1]
  redis.call('HSET', KEYS[5], 'd', records_cursor)
end
return {removed, purged, claims_cursor, records_cursor, examined, read}
