-- Shared preamble, prepended to every script that reads the time.
-- Returns the caller's time when it sent one (ARGV "now" not empty), else the server's clock:
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
local function parse_entry(entry)
  local instance, created, expires, owner = string.match(entry, '^(%d+):(%d+):(%d+):(.*)$')
  return instance, tonumber(created), tonumber(expires), owner
end
