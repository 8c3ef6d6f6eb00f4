-- Give a processing task back for another attempt, if the caller's attempt still holds it.
-- KEYS[1] = task records hash of the lane               (P:lane:{L}:tasks)
-- KEYS[2] = due sorted set of the task's kind           (P:lane:{L}:due:<kind>)
-- KEYS[3] = processing sorted set of the task's kind    (P:lane:{L}:processing:<kind>)
-- ARGV[1] = task member (zero-padded id)
-- ARGV[2] = the attempt's processing token
-- ARGV[3] = next_run_at, epoch microseconds
-- returns: {status}  0 OK | 2 NOT_FOUND | 4 TOKEN_MISMATCH | 5 NOT_PROCESSING
local record, status = owned_record(KEYS[1], ARGV[1], ARGV[2])
if not record then
  return {status}
end
if record.status ~= 'processing' then
  return {NOT_PROCESSING}
end
record.status = 'retry'
record.next_run_at_us = ARGV[3]
record.lease_expires_at_us = ''
-- the attempt's key goes with its lease: nothing of an idle key stays in the lane
record.key = nil
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(record))
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
return {OK}
