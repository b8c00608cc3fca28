-- Argo CD health check of packtrain.dev/PackJob (resource.customizations.health.packtrain.dev_PackJob).
-- Argo CD runs it in gopher-lua (Lua 5.1) with the object in the global `obj`.
local hs = {}

local function condition(status, wanted)
  if status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == wanted then
      return c
    end
  end
  return nil
end

local function message_of(c)
  if c ~= nil and c.message ~= nil and c.message ~= "" then
    return c.message
  end
  return nil
end

-- `status.stage` is the human-readable progress, e.g. "convert 3/4".
local function progress(status)
  return status.stage
end

local status = obj.status
if status == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the packtrain operator"
  return hs
end

-- A status written for an older spec says nothing about the current one.
local generation = obj.metadata and obj.metadata.generation
if generation ~= nil and status.observedGeneration ~= nil and status.observedGeneration < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local failed = condition(status, "Failed")
local succeeded = condition(status, "Succeeded")
local ready = condition(status, "Ready")
local phase = status.phase
if phase == nil then
  if failed ~= nil and failed.status == "True" then
    phase = "Failed"
  elseif succeeded ~= nil and succeeded.status == "True" then
    phase = "Succeeded"
  end
end

if phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = message_of(succeeded) or message_of(ready) or "Succeeded"
  return hs
end
if phase == "Failed" then
  hs.status = "Degraded"
  hs.message = message_of(failed) or message_of(ready) or "Failed"
  return hs
end
-- A deadline passed (pods unschedulable, a stage without progress): the operator sets Degraded.
local degraded = condition(status, "Degraded")
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = message_of(degraded) or "Degraded"
  return hs
end
local message = message_of(ready) or progress(status)

local known = { Pending = true, Converting = true, Planning = true, Materializing = true }
hs.status = "Progressing"
if phase == nil then
  hs.message = message or "Waiting for the packtrain operator"
elseif known[phase] then
  hs.message = message or phase
else
  hs.message = "Unknown phase " .. tostring(phase)
end
return hs
