-- Mark a processing task done, if the caller's attempt still holds it.
-- KEYS[1] = task records hash of the lane               (P:lane:{L}:tasks)
-- KEYS[2] = processing sorted set of the task's kind    (P:lane:{L}:processing:<kind>)
-- ARGV[1] = task member (zero-padded id)
-- ARGV[2] = the attempt's processing token
-- returns: {status}  0 OK | 1 ALREADY_DONE | 2 NOT_FOUND | 4 TOKEN_MISMATCH | 5 NOT_PROCESSING
local record, status = owned_record(KEYS[1], ARGV[1], ARGV[2])
if not record then
  return {status}
end
if record.status == 'done' then
  return {ALREADY_DONE}
end
if record.status ~= 'processing' then
  return {NOT_PROCESSING}
end
record.status = 'done'
-- the attempt's key goes with its lease: nothing of an idle key stays in the lane
record.key = nil
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(record))
redis.call('ZREM', KEYS[2], ARGV[1])
return {OK}
