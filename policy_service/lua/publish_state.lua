-- Compare-and-publish a successor state. The manifest is not looked at here: it lives in
-- another hash slot, and the store checks that it is registered first (policy_service.store).
-- KEYS[1] req:{request_id}
-- ARGV[1] request_generation   ARGV[2] parent_state_generation   ARGV[3] state_generation
-- ARGV[4] cache_generation     ARGV[5] receipt_digest            ARGV[6] manifest sha
-- ARGV[7] phase   ARGV[8] prefill worker ('' keeps)   ARGV[9] decode worker ('' keeps)
-- ARGV[10] lease_ms
-- -> {'missing'} | fence_reply('published'|'already'|'stale'|'ended')
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'missing'}
end
local cur = redis.call('HMGET', KEYS[1], 'request_generation', 'state_generation',
  'cache_generation', 'receipt_digest', 'manifest_sha', 'phase')
if cur[6] == 'ended' then
  return fence_reply('ended')
end
if tonumber(cur[1]) ~= tonumber(ARGV[1]) then
  return fence_reply('stale')
end
if tonumber(cur[2]) == tonumber(ARGV[3]) and cur[4] == ARGV[5]
    and tonumber(cur[3]) == tonumber(ARGV[4]) and cur[5] == ARGV[6] then
  redis.call('PEXPIRE', KEYS[1], ARGV[10])
  return fence_reply('already')
end
if tonumber(cur[2]) ~= tonumber(ARGV[2]) or tonumber(ARGV[4]) < tonumber(cur[3]) then
  return fence_reply('stale')
end
local update = {'state_generation', ARGV[3], 'cache_generation', ARGV[4],
  'receipt_digest', ARGV[5], 'manifest_sha', ARGV[6], 'phase', ARGV[7], 'updated_at', now_ms()}
if ARGV[8] ~= '' then
  table.insert(update, 'prefill')
  table.insert(update, ARGV[8])
end
if ARGV[9] ~= '' then
  table.insert(update, 'decode')
  table.insert(update, ARGV[9])
end
redis.call('HSET', KEYS[1], unpack(update))
redis.call('PEXPIRE', KEYS[1], ARGV[10])
return fence_reply('published')
