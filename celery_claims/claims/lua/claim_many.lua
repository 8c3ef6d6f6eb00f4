-- Several claims and completion records of one queue in one script call: each runs as claim.lua
-- or ack_done.lua (without kombu's keys) would alone, in the order given, and gets the reply
-- that script would give. The loader (claims/redis.py, _source) defines claim(KEYS, ARGV) and
-- ack_done(KEYS, ARGV) from claim.lua and ack_done.lua, ahead of this file.
-- KEYS[1] = claims hash of the queue        ({q}:c)
-- KEYS[2] = instance counter of the queue   ({q}:n)
-- KEYS[3] = stats hash of the queue         ({q}:s)
-- KEYS[4] = completion records of the queue ({q}:d)
-- KEYS[5] = owners hash of the queue        ({q}:o)
-- ARGV = the calls, one after the other, each an operation code and its script's ARGV:
--        'c', ARGV[1..7] of claim.lua
--        'r', ARGV[1..6] of ack_done.lua (ARGV[6] = '': a record, no delivery to remove)
-- returns: {reply of the first call, reply of the second, ...}
-- ack_done.lua's KEYS[1..4] (release.lua's) are claim.lua's without the instance counter
local release_keys = {KEYS[1], KEYS[3], KEYS[4], KEYS[5]}
local replies = {}
local i = 1
while i <= #ARGV do
  local op = ARGV[i]
  local n
  if op == 'c' then
    n = 7
  elseif op == 'r' then
    n = 6
  else
    -- checked before anything is written: a malformed call changes no state
    return redis.error_reply('claim_many: unknown operation ' .. tostring(op))
  end
  if i + n > #ARGV then
    return redis.error_reply('claim_many: arguments of the last call missing')
  end
  i = i + n + 1
end
i = 1
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'c' then
    replies[#replies + 1] = claim(KEYS, {unpack(ARGV, i + 1, i + 7)})
    i = i + 8
  else
    replies[#replies + 1] = ack_done(release_keys, {unpack(ARGV, i + 1, i + 6)})
    i = i + 7
  end
end
return replies
