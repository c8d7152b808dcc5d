-- Create or advance a request: a fresh generation from the global counter (so a request id
-- reused after its key expired still gets a larger generation), state reset to 0.
-- KEYS[1] req:{request_id}   KEYS[2] request generation counter
-- ARGV[1] lease_ms
local generation = redis.call('INCR', KEYS[2])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'request_generation', generation, 'state_generation', 0,
  'cache_generation', 0, 'receipt_digest', '', 'manifest_sha', '', 'phase', 'begun',
  'prefill', '', 'decode', '', 'updated_at', now_ms())
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return fence_reply('begun')
