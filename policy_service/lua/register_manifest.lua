-- Store a manifest once and index it under (name, policy_generation).
-- KEYS[1] manifest:{sha}   KEYS[2] policy:{name}   KEYS[3] manifests (index); all three in
-- the registry's hash slot (policy_service.store.KeySchema)
-- ARGV[1] sha   ARGV[2] canonical JSON   ARGV[3] name   ARGV[4] policy_generation
-- -> {'created'|'exists'|'conflict', sha currently registered under (name, generation)}
-- Each key is written where it is missing, so registering again heals a partial loss (an
-- evicted or deleted key); 'created' means something had to be written.
local holder = redis.call('HGET', KEYS[2], ARGV[4])
if holder and holder ~= ARGV[1] then
  return {'conflict', holder}
end
local entry = ARGV[4] .. ':' .. ARGV[3]
local wrote = redis.call('SET', KEYS[1], ARGV[2], 'NX')
local indexed = redis.call('HGET', KEYS[3], ARGV[1]) == entry
if holder and not wrote and indexed then
  -- Rewritten unchanged so that this reply, too, follows a write that WAIT can confirm
  -- (policy_service.durability).
  redis.call('HSET', KEYS[3], ARGV[1], entry)
  return {'exists', holder}
end
redis.call('HSET', KEYS[2], ARGV[4], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], entry)
return {'created', ARGV[1]}
