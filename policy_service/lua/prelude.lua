-- Prepended to every script. KEYS[1] is the request hash where a script has one.
-- Request hash fields, in the order every fence reply lists them.
local FENCE_FIELDS = {'request_generation', 'state_generation', 'cache_generation',
  'receipt_digest', 'manifest_sha', 'phase', 'prefill', 'decode', 'updated_at'}

-- Redis's own clock, so every service replica stamps with the same time source.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- {status, lease_remaining_ms, FENCE_FIELDS values...}
local function fence_reply(status)
  local values = redis.call('HMGET', KEYS[1], unpack(FENCE_FIELDS))
  local reply = {status, redis.call('PTTL', KEYS[1])}
  for i = 1, #FENCE_FIELDS do
    reply[i + 2] = values[i]
  end
  return reply
end
