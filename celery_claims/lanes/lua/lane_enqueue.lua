-- Add a pending task to its lane.
-- KEYS[1] = task records hash of the lane        (P:lane:{L}:tasks)
-- KEYS[2] = due sorted set of the task's kind    (P:lane:{L}:due:<kind>)
-- ARGV[1] = task member (zero-padded id)
-- ARGV[2] = task record, JSON with string values
-- ARGV[3] = next_run_at, epoch microseconds
-- returns: {status}  0 OK | 3 EXISTS

if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  return {EXISTS}
end
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
return {OK}
