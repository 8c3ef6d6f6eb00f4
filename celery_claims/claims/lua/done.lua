-- Read a task's live completion record (done or given up).
-- KEYS[1] = completion records of the queue ({q}:d)
-- ARGV[1] = task id
-- ARGV[2] = now in epoch ms, or '' for the server clock
-- returns: {7 DONE, instance, done_at, owner} | {8 GIVEN_UP, takeovers, given_up_at, owner},
--          or {} when absent or past its retention
local record = redis.call('HGET', KEYS[1], ARGV[1])
if not record then
  return {}
end
local status, number, at, until_ms, owner = parse_record(record)
if now_ms(ARGV[2]) >= until_ms then
  return {}
end
return {status, number, at, owner}
