-- Mark a request ended (idempotent) and shorten its lease to the end retention, so late
-- work from zombie workers is answered "ended" for a while and the key then disappears.
-- KEYS[1] req:{request_id}
-- ARGV[1] request_generation   ARGV[2] retention_ms   ARGV[3] the identity ending it
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'missing'}
end
local caller = ARGV[3] or ''
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner and owner ~= caller then
  return {'foreign'}
end
local cur = redis.call('HMGET', KEYS[1], 'request_generation', 'phase')
if tonumber(cur[1]) ~= tonumber(ARGV[1]) then
  return fence_reply('stale')
end
if cur[2] == 'ended' then
  -- Rewrite a field unchanged: an acknowledged reply always follows a write of its own, so
  -- the WAIT after it covers an earlier attempt's unconfirmed write (policy_service.durability).
  redis.call('HSET', KEYS[1], 'phase', 'ended')
  return fence_reply('already')
end
redis.call('HSET', KEYS[1], 'phase', 'ended', 'updated_at', now_ms())
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return fence_reply('ended')
