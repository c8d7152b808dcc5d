-- Create or advance a request: a fresh generation, state reset to 0. The generation is
-- strictly above every one issued for this request id before (why: policy_service.store):
--   max(Redis TIME in microseconds, the live request's generation + 1,
--       the request id's high-water key + 1, the caller's floor)
-- KEYS[1] req:{request_id}   KEYS[2] gen:{request_id} (the high-water key; one slot: both
-- keys carry the request id as their hash tag)
-- ARGV[1] lease_ms   ARGV[2] the caller's floor (above every generation it has handed out)
-- ARGV[3] the identity beginning it ('' on an unauthenticated development stack): a live
-- request id belongs to the identity that began it, and nobody else may begin it again.
-- ARGV[4] how long (ms) the high-water key outlives the instant its generation stands for
local caller = ARGV[3] or ''
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner and owner ~= caller then
  return {'foreign'}
end
local t = redis.call('TIME')
local generation = math.max(
  tonumber(t[1]) * 1000000 + tonumber(t[2]),
  (tonumber(redis.call('HGET', KEYS[1], 'request_generation')) or 0) + 1,
  (tonumber(redis.call('GET', KEYS[2])) or 0) + 1,
  tonumber(ARGV[2]) or 0)
-- Lua numbers print as %.14g: format the generation (< 2^53) as an integer explicitly.
local text = string.format('%d', generation)
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'request_generation', text, 'state_generation', 0,
  'cache_generation', 0, 'receipt_digest', '', 'manifest_sha', '', 'phase', 'begun',
  'prefill', '', 'decode', '', 'updated_at', now_ms(), 'owner', caller)
redis.call('PEXPIRE', KEYS[1], ARGV[1])
-- The high-water key expires (on Redis's clock, as an absolute instant) only once that clock
-- has passed the generation by ARGV[4]: after that, TIME alone is above it.
local expire_at = math.floor(generation / 1000) + (tonumber(ARGV[4]) or 60000)
redis.call('SET', KEYS[2], text, 'PXAT', string.format('%d', expire_at))
return fence_reply('begun')
