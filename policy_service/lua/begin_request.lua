-- Create or advance a request: a fresh generation from the global counter (so a request id
-- reused after its key expired still gets a larger generation), state reset to 0.
-- KEYS[1] req:{request_id}   KEYS[2] request generation counter
-- ARGV[1] lease_ms   ARGV[2] the caller's floor (above every generation it has handed out)
if redis.call('EXISTS', KEYS[2]) == 0 then
  -- A fresh or wiped Redis: restart above every generation issued before the loss, so no
  -- work from before can match a request begun after it. Redis's clock in microseconds is
  -- past any counter set earlier (that would take a million BeginRequests a second); the
  -- caller's floor covers a clock that went back.
  local t = redis.call('TIME')
  local floor = math.max(tonumber(t[1]) * 1000000 + tonumber(t[2]), tonumber(ARGV[2]))
  redis.call('SET', KEYS[2], string.format('%d', floor))
end
local generation = redis.call('INCR', KEYS[2])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'request_generation', generation, 'state_generation', 0,
  'cache_generation', 0, 'receipt_digest', '', 'manifest_sha', '', 'phase', 'begun',
  'prefill', '', 'decode', '', 'updated_at', now_ms())
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return fence_reply('begun')
