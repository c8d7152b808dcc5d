-- Read a request's fence and lease in one atomic step.
-- KEYS[1] req:{request_id}
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'missing'}
end
return fence_reply('ok')
