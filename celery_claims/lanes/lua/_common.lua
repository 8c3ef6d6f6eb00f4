-- Shared preamble, prepended to every lane script.

-- Status codes (StoreStatus in model.py).
local OK, ALREADY_DONE, NOT_FOUND, EXISTS, TOKEN_MISMATCH, NOT_PROCESSING = 0, 1, 2, 3, 4, 5

-- The record of a task, if the caller's attempt (its processing token) still owns it; else nil
-- and the status to answer. The token is checked before any status: a later attempt's task is
-- never this attempt's business.
local function owned_record(tasks_key, member, token)
  local raw = redis.call('HGET', tasks_key, member)
  if not raw then
    return nil, NOT_FOUND
  end
  local record = cjson.decode(raw)
  if record.token ~= token then
    return nil, TOKEN_MISMATCH
  end
  return record, OK
end
