-- Store a manifest once and index it under (name, policy_generation).
-- KEYS[1] manifest:{sha}   KEYS[2] policy:{name}   KEYS[3] manifests (index)
-- ARGV[1] sha   ARGV[2] canonical JSON   ARGV[3] name   ARGV[4] policy_generation
-- -> {'created'|'exists'|'conflict', sha currently registered under (name, generation)}
local holder = redis.call('HGET', KEYS[2], ARGV[4])
if holder then
  if holder ~= ARGV[1] then
    return {'conflict', holder}
  end
  return {'exists', holder}
end
redis.call('SET', KEYS[1], ARGV[2], 'NX')
redis.call('HSET', KEYS[2], ARGV[4], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[4] .. ':' .. ARGV[3])
return {'created', ARGV[1]}
