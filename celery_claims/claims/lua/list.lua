-- List or count the unexpired claims of a queue (the whole hash, in one script: every entry
-- seen once, which a scan from the client across calls would not promise).
-- KEYS[1] = claims hash of the queue        ({q}:c)
-- KEYS[2] = owners hash of the queue        ({q}:o)
-- ARGV[1] = now in epoch ms, or '' for the server clock
-- ARGV[2] = 'count' for the number only, 'list' for the entries
-- returns: count, or {task_1, instance_1, created_at_1, expires_at_1, owner_1, task_2, ...}
--          in no particular order
local now = now_ms(ARGV[1])
local listing = ARGV[2] == 'list'
local count, out = 0, {}
local cursor = '0'
repeat
  local page = redis.call('HSCAN', KEYS[1], cursor, 'COUNT', 1000)
  cursor = page[1]
  local items = page[2]
  for i = 1, #items, 2 do
    local e = parse_entry(items[i + 1])
    if now < e.expires then
      count = count + 1
      if listing then
        out[#out + 1] = items[i]
        out[#out + 1] = e.instance
        out[#out + 1] = e.created
        out[#out + 1] = e.expires
        out[#out + 1] = owner_of(KEYS[2], e)
      end
    end
  end
until cursor == '0'
if listing then
  return out
end
return count
