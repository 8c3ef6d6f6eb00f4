-- Apply a batch of writes at most once: a marker key records that the effect was applied.
-- KEYS[1] = the marker key (on Redis Cluster: the same hash slot as every written key)
-- KEYS[1 + i] = the key op i writes, for i = 1 .. #KEYS - 1
-- ARGV[1] = the writer's fencing number (decimal digits), stored as the marker's value
-- ARGV[2] = the marker's TTL in ms, or '' to keep it until it is deleted
-- ARGV[3 ...] = op i as: command, number of arguments n, its n arguments (its key is KEYS[1 + i])
-- returns: {1} applied, marker set | {0, marker value} already applied, nothing written
--          | {2, i} op i meets a key of another type | {3, i} op i increments a value that is not
--          an integer or could overflow | {4, i} op i is not an allowed command
--          (codes 2 to 4 write nothing: every op is checked before the first write, because a
--          script that fails half way keeps the writes it made before the failure)

local marker = redis.call('GET', KEYS[1])
if marker then
  return {0, marker}
end

-- the type each command needs (false: any type), and the type it leaves the key with
local NEEDS = {SET = false, DEL = false, INCRBY = 'string', HINCRBY = 'hash', HSET = 'hash',
               RPUSH = 'list', SADD = 'set', ZADD = 'zset'}
local LEAVES = {SET = 'string', DEL = 'none', INCRBY = 'string', HINCRBY = 'hash', HSET = 'hash',
                RPUSH = 'list', SADD = 'set', ZADD = 'zset'}
-- Lua numbers are doubles: a sum kept below 2^62 cannot pass Redis's int64 limit of 2^63
local LIMIT = 2 ^ 62

local ops = {}
local at = 3
for i = 1, #KEYS - 1 do
  local n = tonumber(ARGV[at + 1])
  local args = {}
  for j = 1, n do
    args[j] = ARGV[at + 1 + j]
  end
  ops[i] = {command = ARGV[at], args = args}
  at = at + 2 + n
end

-- what the ops will have made of each key so far: its type, a string's value, a hash's fields
-- (nil: not read yet; false: known to be absent), and whether the hash is known to hold no
-- field but those tracked (it was absent, or deleted or replaced by an earlier op)
local kinds, strings, fields, fresh = {}, {}, {}, {}

local function kind_of(key)
  if kinds[key] == nil then
    kinds[key] = redis.call('TYPE', key)['ok']
    if kinds[key] == 'none' then
      strings[key], fields[key], fresh[key] = false, {}, true
    end
  end
  return kinds[key]
end

local function reset(key, kind)
  kinds[key], strings[key], fields[key], fresh[key] = kind, false, {}, true
end

local function field_of(key, field)
  fields[key] = fields[key] or {}
  if fields[key][field] == nil then
    fields[key][field] = (not fresh[key]) and redis.call('HGET', key, field)
  end
  return fields[key][field]
end

-- the value as Redis reads an integer (no '+', no leading zero, at most 20 characters)
local function integer(text)
  if text == false then
    return 0
  end
  if type(text) == 'number' then
    return text
  end
  if #text <= 20 and (text == '0' or string.find(text, '^%-?[1-9]%d*$')) then
    return tonumber(text)
  end
  return nil
end

local function add(current, by)
  local base = integer(current)
  if base == nil then
    return nil
  end
  local sum = base + tonumber(by)
  if math.abs(sum) >= LIMIT then
    return nil
  end
  return sum
end

for i, op in ipairs(ops) do
  local key, command, args = KEYS[i + 1], op.command, op.args
  local needs = NEEDS[command]
  if needs == nil then
    return {4, i}
  end
  local kind = kind_of(key)
  if needs and kind ~= 'none' and kind ~= needs then
    return {2, i}
  end
  if command == 'SET' then
    reset(key, 'string')
    strings[key] = args[1]
  elseif command == 'DEL' then
    reset(key, 'none')
  elseif command == 'INCRBY' then
    if strings[key] == nil then
      strings[key] = redis.call('GET', key)
    end
    local sum = add(strings[key], args[1])
    if sum == nil then
      return {3, i}
    end
    strings[key] = sum
  elseif command == 'HINCRBY' then
    local sum = add(field_of(key, args[1]), args[2])
    if sum == nil then
      return {3, i}
    end
    fields[key][args[1]] = sum
  elseif command == 'HSET' then
    fields[key] = fields[key] or {}
    for j = 1, #args, 2 do
      fields[key][args[j]] = args[j + 1]
    end
  end
  kinds[key] = LEAVES[command]
end

for i, op in ipairs(ops) do
  redis.call(op.command, KEYS[i + 1], unpack(op.args))
end
if ARGV[2] == '' then
  redis.call('SET', KEYS[1], ARGV[1])
else
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
return {1}
