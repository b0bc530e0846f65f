-- catsproto.lua: Wireshark/tshark dissector for the catsproto cache-state BGP path attribute.
--
-- Wireshark's BGP dissector shows an unassigned attribute type (255 here) as "Unknown"
-- and refuses BGP messages over 4096 bytes (RFC 8654 extended messages), although it
-- still reassembles them over TCP. So this is a post-dissector: for every BGP message
-- the BGP dissector framed (its "bgp" protocol item spans the whole message), it walks
-- the UPDATE itself, finds the path attributes of our type code (a preference, 255 by
-- default; the Partial and Extended-Length bits are honoured, a missing Optional or
-- Transitive bit is an expert warning, the low four bits are ignored) and
-- shows every TLV and field under a "catsproto" tree. Field names follow the codec:
-- catsproto.<tlv>.<field>, e.g. catsproto.origin.cs_id, catsproto.cache_summaries.tier.
-- The layouts below mirror catsproto/wire/tlvs.py; tests/test_dissector.py checks the
-- fields against the codec on a real capture. Lenient like a viewer, but it says what
-- the codec refuses: every rule local to the attribute (framing, TLV order, mandatory
-- TLVs, version, ranges, registered enum values, list order, finite floats, Ed25519
-- lengths, scope entries, UTF-8) is an expert info on the field that breaks it, and the
-- dissection goes on where it still can; a length that overruns its window is flagged
-- and the rest of that TLV left out. tests/test_dissector_expert.py checks, on mutated
-- vectors, that tshark flags exactly what the codec refuses. The route shown is the
-- UPDATE's IPv4 NLRI or the prefixes of its MP_REACH_NLRI (IPv6 too).
--
-- Use: tshark -X lua_script:lab/wireshark/catsproto.lua -r capture.pcap -V
-- or install it as a personal plugin: catsproto dissector install

local cats = Proto("catsproto", "CATS KV-cache state (catsproto)")
cats.prefs.type_code = Pref.uint("Path attribute type code", 255,
  "BGP path attribute type code carrying catsproto TLVs (255 = reserved for development)")

local function names(list)
  local t = {}
  for i, n in pairs(list) do t[i] = n end
  return t
end

local TLV_NAMES = names({
  [1] = "version", [2] = "origin", [3] = "sequence", [4] = "timestamp",
  [16] = "metrics-l0", [17] = "metrics-l1", [18] = "metrics-l2", [19] = "metrics-basis",
  [32] = "cache-model", [33] = "cache-summaries", [34] = "capacity",
  [35] = "hot-prefixes", [36] = "sealed-cache", [254] = "delegation", [255] = "signature",
})
local ENUMS = {
  tier = { [1] = "hbm", [2] = "dram", [3] = "ssd", [4] = "remote" },
  kind = { [1] = "exact", [2] = "bloom", [3] = "fuse", [4] = "delta" },
  key_scheme = { [1] = "blake2b64-chained" },
  category = { [1] = "computing", [2] = "communication", [3] = "service", [4] = "composed" },
  normalisation = { [1] = "queue-reference" },
  unit = { [1] = "count", [2] = "percent", [3] = "milliseconds", [4] = "microseconds",
           [5] = "bits-per-second", [6] = "bytes", [7] = "tokens-per-second",
           [8] = "requests-per-second" },
  statistic = { [1] = "current", [2] = "mean", [3] = "min", [4] = "max", [5] = "p50",
                [6] = "p95", [7] = "p99" },
  source = { [1] = "nominal", [2] = "measured", [3] = "estimated", [4] = "aggregated" },
  signature_algorithm = { [1] = "ed25519" },
  aead = { [1] = "chacha20-poly1305" },
  scope_kind = { [1] = "cs-id", [2] = "route", [3] = "address", [4] = "site" },
  metric_type = { [1] = "gpu-utilization", [2] = "running-requests", [3] = "waiting-requests",
                  [4] = "prefill-throughput", [5] = "decode-throughput",
                  [6] = "kv-cache-utilization", [7] = "queue-delay", [8] = "inter-token-latency",
                  [9] = "network-delay", [10] = "network-bandwidth",
                  [11] = "outstanding-prefill-tokens" },
}

-- ---- fields ------------------------------------------------------------------------------
local F = {}
local fields = {}
local function field(abbrev, pf) F[abbrev] = pf; fields[#fields + 1] = pf end

field("flags", ProtoField.uint8("catsproto.flags", "Attribute flags", base.HEX))
field("partial", ProtoField.bool("catsproto.flags.partial", "Partial", 8, nil, 0x20))
field("extended", ProtoField.bool("catsproto.flags.extended_length", "Extended length", 8, nil, 0x10))
field("type_code", ProtoField.uint8("catsproto.type_code", "Attribute type code"))
field("length", ProtoField.uint16("catsproto.length", "Value length"))
field("nlri", ProtoField.string("catsproto.nlri", "Route (NLRI)"))
field("tlv", ProtoField.bytes("catsproto.tlv", "TLV"))
field("tlv_type", ProtoField.uint16("catsproto.tlv.type", "Type", base.DEC, TLV_NAMES))
field("tlv_length", ProtoField.uint16("catsproto.tlv.length", "Length"))
field("item_length", ProtoField.uint16("catsproto.item_length", "Entry length"))

-- Layout kinds: u8 u16 u32 u64 f64, enum8/enum16 (with a names table), blob8 (u8 length
-- then bytes), text8 (u8 length then UTF-8), rest (bytes to the end of the window),
-- address (AFI u16 then 4 or 16 bytes), items (records to the end of the window, each
-- behind a u16 length when prefix = 2).
local PF = {
  u8 = ProtoField.uint8, u16 = ProtoField.uint16, u32 = ProtoField.uint32,
  u64 = ProtoField.uint64, f64 = ProtoField.double,
}

local function declare(prefix, layout)
  for _, f in ipairs(layout) do
    local name, kind = f[1], f[2]
    local abbrev = prefix .. "." .. name
    if kind == "items" then
      field(abbrev, ProtoField.bytes("catsproto." .. abbrev, name))
      declare(prefix, f.item)
    elseif kind == "enum8" or kind == "enum16" then
      local ctor = kind == "enum8" and ProtoField.uint8 or ProtoField.uint16
      field(abbrev, ctor("catsproto." .. abbrev, name, base.DEC, ENUMS[f.names]))
    elseif kind == "blob8" or kind == "text8" then
      field(abbrev .. "_len", ProtoField.uint8("catsproto." .. abbrev .. "_len", name .. " length"))
      if kind == "text8" then
        field(abbrev, ProtoField.string("catsproto." .. abbrev, name))
      else
        field(abbrev, ProtoField.bytes("catsproto." .. abbrev, name))
      end
    elseif kind == "rest" then
      field(abbrev, ProtoField.bytes("catsproto." .. abbrev, name))
    elseif kind == "address" then
      field(abbrev .. ".afi", ProtoField.uint16("catsproto." .. abbrev .. ".afi", "AFI"))
      field(abbrev, ProtoField.ipv4("catsproto." .. abbrev, name))
      field(abbrev .. "6", ProtoField.ipv6("catsproto." .. abbrev .. "6", name))
    elseif f.hex then
      field(abbrev, PF[kind]("catsproto." .. abbrev, name, base.HEX))
    else
      field(abbrev, PF[kind]("catsproto." .. abbrev, name))
    end
  end
end

-- Field options the interpreter checks (codec rules): min / max for integers; enums are
-- closed (a value missing from the names table is refused) unless open = true (then min
-- still applies); min for the length of blob8 / text8 / rest. A layout's `check`
-- function sees the record's values and returns a refusal or nil; items lists declare
-- the fields they are strictly increasing by in `order`.
local L0 = { { "metric_type", "enum16", names = "metric_type", open = true, min = 1 },
             { "unit", "enum8", names = "unit" },
             { "statistic", "enum8", names = "statistic" }, { "source", "enum8", names = "source" },
             { "value", "f64" } }
local ENTRY = { { "tier", "enum8", names = "tier" },
                { "kind", "enum8", names = "kind", open = true, min = 1 },
                { "version", "u32", min = 1 }, { "base_version", "u32" },
                { "key_lo", "u64", hex = true }, { "key_hi", "u64", hex = true },
                { "entry_count", "u32" }, { "bytes_per_block", "u32" },
                { "fetch_latency_us", "u32" }, { "fetch_bandwidth_mbps", "u32" },
                { "params", "blob8" }, { "body", "rest" } }
local SCOPE = { { "kind", "enum8", names = "scope_kind" }, { "value", "blob8" } }

-- TLV type -> { field-name prefix, layout }
local LAYOUTS = {
  [1] = { "version", { { "version", "u8", min = 1, max = 1 } } },
  [2] = { "origin", { { "cs_id", "u32", min = 1 }, { "site_id", "u32" },
                      { "address", "address" } } },
  [3] = { "sequence", { { "epoch", "u32" }, { "sequence", "u64" } } },
  [4] = { "timestamp", { { "ms", "u64" } } },
  [16] = { "metrics_l0", { { "metrics", "items", item = L0,
                             order = { "metric_type", "statistic", "source" } } } },
  [17] = { "metrics_l1", { { "scores", "items", order = { "category" }, item = {
    { "category", "enum8", names = "category" }, { "score", "u8", max = 10 } } } } },
  [18] = { "metrics_l2", { { "score", "u8", max = 10 } } },
  [19] = { "metrics_basis", { { "window_ms", "u64" },
                              { "normalisation", "enum8", names = "normalisation", open = true,
                                min = 1 },
                              { "reference_ms", "u32", min = 1 } } },
  [32] = { "cache_model", { { "model_id", "text8" }, { "block_size", "u32", min = 1 },
                            { "key_scheme", "enum8", names = "key_scheme", open = true, min = 1 },
                            { "secret_id", "u32" } } },
  [33] = { "cache_summaries", { { "entries", "items", prefix = 2, item = ENTRY,
                                  order = { "tier" } } } },
  [34] = { "capacity", { { "free_blocks", "u64" }, { "total_blocks", "u64" } } },
  [35] = { "hot_prefixes", { { "prefixes", "items", order = { "block_key" }, item = {
    { "block_key", "u64", hex = true }, { "depth", "u32", min = 1 } } } } },
  [36] = { "sealed_cache", { { "algorithm", "enum8", names = "aead", open = true, min = 1 },
                             { "key_id", "u32" },
                             { "nonce", "blob8", min = 1 }, { "ciphertext", "rest", min = 1 } } },
  [254] = { "delegation", { { "algorithm", "enum8", names = "signature_algorithm" },
                            { "operator_key_id", "blob8", min = 1 },
                            { "node_key", "blob8", min = 1 },
                            { "not_before_ms", "u64" }, { "not_after_ms", "u64" },
                            { "operator_signature", "blob8", min = 1 },
                            { "scope", "items", item = SCOPE, order = { "kind", "value" } } } },
  [255] = { "signature", { { "algorithm", "enum8", names = "signature_algorithm" },
                           { "key_id", "blob8", min = 1 }, { "signature", "rest", min = 1 } } },
}
for _, l in pairs(LAYOUTS) do declare(l[1], l[2]) end
field("unknown.value", ProtoField.bytes("catsproto.unknown.value", "Value"))


-- ---- cross-field rules (as each record's `validate` in catsproto/wire/tlvs.py) ------------
local function bytes_cmp(a, b)
  for k = 1, math.min(#a, #b) do
    local x, y = a:byte(k), b:byte(k)
    if x ~= y then return x < y and -1 or 1 end
  end
  if #a == #b then return 0 end
  return #a < #b and -1 or 1
end

local function cmp(a, b)  -- numbers, UInt64 or byte strings: -1, 0, 1
  if type(a) == "string" then return bytes_cmp(a, b) end
  if a == b then return 0 end
  return a < b and -1 or 1
end

local PREFIX_BITS = { [5] = 32, [17] = 128 }  -- scope value length -> address bits

local function check_scope(rec)
  local v = rec.value
  if rec.kind == 1 then
    if #v ~= 4 or v == "\0\0\0\0" then return "cs-id scope value must be a u32 above 0" end
    return nil
  end
  if rec.kind == 4 then
    if #v ~= 4 then return string.format("site scope value is %d bytes, not 4", #v) end
    return nil
  end
  local bits = PREFIX_BITS[#v]
  if bits == nil then return string.format("scope value is %d bytes, not 5 or 17", #v) end
  local plen = v:byte(1)
  if plen > bits then return string.format("prefix length %d above %d", plen, bits) end
  for k = 2, #v do
    local keep = plen - (k - 2) * 8
    local mask = keep >= 8 and 0xff or (keep <= 0 and 0 or 0xff - (2 ^ (8 - keep) - 1))
    if bit.band(v:byte(k), 0xff - mask) ~= 0 then return "prefix has host bits set" end
  end
  return nil
end

-- TLV name -> check of the TLV's record; list name -> check of each of its items
local CHECKS = {
  metrics_basis = function(rec)
    if tostring(rec.window_ms) == "0" then return "window_ms 0 outside 1..2^64-1" end
  end,
  capacity = function(rec)
    if rec.free_blocks > rec.total_blocks then return "free_blocks above total_blocks" end
  end,
  sealed_cache = function(rec)
    if rec.algorithm == 1 and #rec.nonce ~= 12 then
      return string.format("ChaCha20-Poly1305 nonce is %d bytes, not 12", #rec.nonce)
    end
    if rec.algorithm == 1 and #rec.ciphertext < 20 then
      return string.format("ChaCha20-Poly1305 ciphertext is %d bytes, fewer than 20", #rec.ciphertext)
    end
  end,
  delegation = function(rec)
    if rec.algorithm == 1 and #rec.operator_key_id ~= 8 then
      return string.format("Ed25519 operator_key_id is %d bytes, not 8", #rec.operator_key_id)
    end
    if rec.algorithm == 1 and #rec.node_key ~= 32 then
      return string.format("Ed25519 node_key is %d bytes, not 32", #rec.node_key)
    end
    if rec.algorithm == 1 and #rec.operator_signature ~= 64 then
      return string.format("Ed25519 operator_signature is %d bytes, not 64",
                           #rec.operator_signature)
    end
    if rec.not_before_ms >= rec.not_after_ms then return "not_before_ms not below not_after_ms" end
    local kinds = {}
    for _, e in ipairs(rec.scope or {}) do kinds[e.kind] = true end
    local missing = {}
    for k, n in ipairs({ "cs-id", "route", "address" }) do
      if not kinds[k] then missing[#missing + 1] = n end
    end
    table.sort(missing)  -- as the codec names them
    if #missing > 0 then return "scope has no " .. table.concat(missing, ", ") .. " entry" end
  end,
  signature = function(rec)
    if rec.algorithm == 1 and #rec.key_id ~= 8 then
      return string.format("Ed25519 key_id is %d bytes, not 8", #rec.key_id)
    end
    if rec.algorithm == 1 and #rec.signature ~= 64 then
      return string.format("Ed25519 signature is %d bytes, not 64", #rec.signature)
    end
  end,
}
-- TLV name -> note on a well-formed record worth flagging (not a refusal): an open code
-- this dissector does not name, where the receiver skips part of the advertisement
local NOTES = {
  cache_model = function(rec)
    if rec.key_scheme >= 1 and ENUMS.key_scheme[rec.key_scheme] == nil then
      return string.format("unknown key scheme %d: the cache summaries cannot be matched here, "
                           .. "the metrics stand and the attribute is well formed", rec.key_scheme)
    end
  end,
  sealed_cache = function(rec)
    if rec.algorithm >= 1 and ENUMS.aead[rec.algorithm] == nil then
      return string.format("unknown algorithm %d: the sealed section cannot be opened here, "
                           .. "the attribute is well formed", rec.algorithm)
    end
  end,
}
local ITEM_CHECKS = {
  scope = check_scope,
  entries = function(rec)  -- a cache-summaries entry
    if rec.key_lo > rec.key_hi then return "key_lo above key_hi" end
    if rec.base_version >= rec.version then return "base_version not below version" end
  end,
}

local function utf8_ok(s)  -- strict, as Python's decoder: no overlongs, surrogates, > U+10FFFF
  local i, n = 1, #s
  while i <= n do
    local c = s:byte(i)
    if c >= 0x80 then
      local len = (c >= 0xC2 and c <= 0xDF and 2) or (c >= 0xE0 and c <= 0xEF and 3)
                  or (c >= 0xF0 and c <= 0xF4 and 4) or nil
      if len == nil or i + len - 1 > n then return false end
      local lo, hi = 0x80, 0xBF
      if c == 0xE0 then lo = 0xA0 elseif c == 0xED then hi = 0x9F
      elseif c == 0xF0 then lo = 0x90 elseif c == 0xF4 then hi = 0x8F end
      local c2 = s:byte(i + 1)
      if c2 < lo or c2 > hi then return false end
      for k = i + 2, i + len - 1 do
        local ck = s:byte(k)
        if ck < 0x80 or ck > 0xBF then return false end
      end
      i = i + len
    else
      i = i + 1
    end
  end
  return true
end

local function f64_problem(tvb, pos)  -- NaN and the infinities, and -0.0, are refused
  local b1, b2 = tvb(pos, 1):uint(), tvb(pos + 1, 1):uint()
  if bit.band(b1, 0x7f) == 0x7f and bit.band(b2, 0xf0) == 0xf0 then
    return "is not a finite number"
  end
  if b1 == 0x80 and tvb(pos + 1, 7):bytes():tohex() == "00000000000000" then
    return "is -0.0 (zero is encoded as +0.0)"
  end
  return nil
end

-- ---- the layout interpreter --------------------------------------------------------------
local e_overrun = ProtoExpert.new("catsproto.overrun", "Field runs past its TLV",
                                  expert.group.MALFORMED, expert.severity.ERROR)
local e_left = ProtoExpert.new("catsproto.unread", "Bytes left unread in the TLV",
                               expert.group.MALFORMED, expert.severity.WARN)
local e_refused = ProtoExpert.new("catsproto.refused", "Refused by the codec",
                                  expert.group.MALFORMED, expert.severity.ERROR)
cats.fields = fields
local e_unknown = ProtoExpert.new("catsproto.unknown_code", "Open code not known here",
                                  expert.group.UNDECODED, expert.severity.NOTE)
local e_flags = ProtoExpert.new("catsproto.flags_missing",
                                "Optional or Transitive flag missing",
                                expert.group.MALFORMED, expert.severity.WARN)
cats.experts = { e_overrun, e_left, e_refused, e_unknown, e_flags }

local WIDTH = { u8 = 1, u16 = 2, u32 = 4, u64 = 8, f64 = 8, enum8 = 1, enum16 = 2 }

local function refuse(item, fmt, ...)
  item:add_proto_expert_info(e_refused, string.format(fmt, ...))
end

-- Dissect `layout` in tvb[pos, stop) under `tree`; returns the position reached and the
-- record's values (numbers, UInt64, byte strings, lists of records), or nil and why on
-- an overrun. Range and enum refusals are flagged where they are and do not stop it.
local function run(tvb, tree, prefix, layout, pos, stop)
  local rec = {}
  for _, f in ipairs(layout) do
    local name, kind = f[1], f[2]
    local abbrev = prefix .. "." .. name
    local w = WIDTH[kind]
    if w then
      if pos + w > stop then return nil, name .. " runs past its TLV" end
      local item = tree:add(F[abbrev], tvb(pos, w))
      local v
      if kind == "u64" then
        v = tvb(pos, w):uint64()
      elseif kind == "f64" then
        v = tvb(pos, w):float()
        local bad = f64_problem(tvb, pos)
        if bad then refuse(item, "%s %s", name, bad) end
      else
        v = tvb(pos, w):uint()
        if (f.min and v < f.min) or (f.max and v > f.max) then
          refuse(item, "%s %d outside %d..%s", name, v, f.min or 0,
                 f.max and tostring(f.max) or "max")
        elseif f.names and not f.open and ENUMS[f.names][v] == nil then
          refuse(item, "%s %d is not a registered value", name, v)
        end
      end
      rec[name] = v
      pos = pos + w
    elseif kind == "blob8" or kind == "text8" then
      if pos + 1 > stop then return nil, name .. " length runs past its TLV" end
      local n = tvb(pos, 1):uint()
      local item = tree:add(F[abbrev .. "_len"], tvb(pos, 1))
      if pos + 1 + n > stop then return nil, name .. " runs past its TLV" end
      local raw = n > 0 and tvb(pos + 1, n):raw() or ""
      if n > 0 then item = tree:add(F[abbrev], tvb(pos + 1, n)) end
      local min = kind == "text8" and 1 or f.min or 0
      if n < min then
        refuse(item, "%s length %d outside %d..255", name, n, min)
      elseif kind == "text8" and not utf8_ok(raw) then
        refuse(item, "%s is not UTF-8", name)
      end
      rec[name] = raw
      pos = pos + 1 + n
    elseif kind == "rest" then
      local n = stop - pos
      local item = tree
      if n > 0 then item = tree:add(F[abbrev], tvb(pos, n)) end
      if f.min and n < f.min then refuse(item, "%s length %d below %d", name, n, f.min) end
      rec[name] = n > 0 and tvb(pos, n):raw() or ""
      pos = stop
    elseif kind == "address" then
      if pos + 2 > stop then return nil, name .. " AFI runs past its TLV" end
      local afi = tvb(pos, 2):uint()
      tree:add(F[abbrev .. ".afi"], tvb(pos, 2))
      local n = (afi == 1 and 4) or (afi == 2 and 16) or nil
      if n == nil then
        return nil, string.format("%s AFI %d is neither 1 (IPv4) nor 2 (IPv6)", name, afi)
      end
      if pos + 2 + n > stop then return nil, name .. " runs past its TLV" end
      tree:add(afi == 1 and F[abbrev] or F[abbrev .. "6"], tvb(pos + 2, n))
      pos = pos + 2 + n
    elseif kind == "items" then
      local list, previous = {}, nil
      if pos >= stop then refuse(tree, "%s is empty: omit the TLV instead", name) end
      while pos < stop do
        local istop = stop
        local start = pos
        if f.prefix == 2 then
          if pos + 2 > stop then return nil, name .. " entry length runs past its TLV" end
          istop = pos + 2 + tvb(pos, 2):uint()
          if istop > stop then return nil, name .. " entry runs past its TLV" end
          pos = pos + 2
        end
        local sub = tree:add(F[abbrev], tvb(start, 0))
        sub:set_text(string.format("%s[%d]", name, #list))
        if f.prefix == 2 then sub:add(F.item_length, tvb(start, 2)) end
        local reached, item = run(tvb, sub, prefix, f.item, pos, istop)
        if reached == nil then return nil, item end
        if f.prefix == 2 and reached ~= istop then
          return nil, name .. " entry leaves bytes unread"
        end
        sub:set_len(reached - start)
        local bad = ITEM_CHECKS[name] and ITEM_CHECKS[name](item)
        if bad then refuse(sub, "%s[%d]: %s", name, #list, bad) end
        if f.order and previous then
          for _, key in ipairs(f.order) do
            local c = cmp(previous[key], item[key])
            if c > 0 then break end
            if c < 0 then goto ordered end
          end
          refuse(sub, "%s not strictly increasing by (%s)", name, table.concat(f.order, ", "))
        end
        ::ordered::
        previous = item
        list[#list + 1] = item
        pos = reached
      end
      rec[name] = list
    end
  end
  return pos, rec
end

local MANDATORY = { 1, 2, 3, 4 }
local MAX_TLVS = 64  -- a value holds at most this many (the draft's framing rule 7)

local function dissect_value(tvb, tree, pos, stop)
  local previous, seen, count = -1, {}, 0
  while pos < stop do
    if pos + 4 > stop then
      tree:add_proto_expert_info(e_overrun, "truncated TLV header")
      return
    end
    local t, n = tvb(pos, 2):uint(), tvb(pos + 2, 2):uint()
    count = count + 1
    if count > MAX_TLVS then
      refuse(tree, "type %d is one TLV more than the %d a value may hold", t, MAX_TLVS)
      return
    end
    local tlv_stop = pos + 4 + n
    local tlv = tree:add(F.tlv, tvb(pos, math.min(4 + n, stop - pos)))
    tlv:set_text(string.format("TLV %s (%d), %d bytes", TLV_NAMES[t] or "unknown", t, n))
    tlv:add(F.tlv_type, tvb(pos, 2))
    tlv:add(F.tlv_length, tvb(pos + 2, 2))
    if t <= previous then
      refuse(tlv, "type %d %s %s: types must be strictly increasing", t,
             t == previous and "repeats" or "comes after", TLV_NAMES[previous] or previous)
    end
    previous, seen[t] = t, true
    if tlv_stop > stop then
      tlv:add_proto_expert_info(e_overrun, string.format(
        "TLV length %d exceeds the %d bytes left in the attribute", n, stop - pos - 4))
      return
    end
    local layout = LAYOUTS[t]
    if layout == nil then
      if n > 0 then tlv:add(F["unknown.value"], tvb(pos + 4, n)) end
    else
      local reached, rec = run(tvb, tlv, layout[1], layout[2], pos + 4, tlv_stop)
      if reached == nil then
        tlv:add_proto_expert_info(e_overrun, rec)
      elseif reached < tlv_stop then
        tlv:add_proto_expert_info(e_left, string.format("%d bytes unread", tlv_stop - reached))
      else
        local bad = CHECKS[layout[1]] and CHECKS[layout[1]](rec)
        if bad then refuse(tlv, "%s", bad) end
        local note = NOTES[layout[1]] and NOTES[layout[1]](rec)
        if note then tlv:add_proto_expert_info(e_unknown, note) end
      end
    end
    pos = tlv_stop
  end
  for _, t in ipairs(MANDATORY) do
    if not seen[t] then refuse(tree, "mandatory %s TLV is missing", TLV_NAMES[t]) end
  end
end

-- ---- BGP framing: find our attribute in each UPDATE --------------------------------------
local function ipv6_text(g)  -- eight 16-bit groups, RFC 5952 (longest zero run as ::)
  local best, best_len, run_at, run_len = nil, 1, nil, 0
  for i = 1, 8 do
    if g[i] == 0 then
      if run_at == nil then run_at, run_len = i, 0 end
      run_len = run_len + 1
      if run_len > best_len then best, best_len = run_at, run_len end
    else
      run_at = nil
    end
  end
  local parts = {}
  local i = 1
  while i <= 8 do
    if i == best then
      parts[#parts + 1] = (i == 1) and ":" or ""
      i = i + best_len
      if i > 8 then parts[#parts + 1] = "" end
    else
      parts[#parts + 1] = string.format("%x", g[i])
      i = i + 1
    end
  end
  return table.concat(parts, ":")
end

-- NLRI prefixes in tvb[pos, stop) of an address family (1 = IPv4, 2 = IPv6).
local function prefixes(tvb, pos, stop, afi, out)
  local width = afi == 2 and 16 or 4
  while pos < stop do
    local bits = tvb(pos, 1):uint()
    local n = math.floor((bits + 7) / 8)
    if bits > width * 8 or pos + 1 + n > stop then break end
    local o = {}
    for i = 1, width do o[i] = i <= n and tvb(pos + i, 1):uint() or 0 end
    if afi == 2 then
      local g = {}
      for i = 1, 8 do g[i] = o[2 * i - 1] * 256 + o[2 * i] end
      out[#out + 1] = string.format("%s/%d", ipv6_text(g), bits)
    else
      out[#out + 1] = string.format("%d.%d.%d.%d/%d", o[1], o[2], o[3], o[4], bits)
    end
    pos = pos + 1 + n
  end
  return out
end

local MP_REACH_NLRI = 14

-- The path attributes of tvb[pos, astop): a list of { flags, code, header, value length }.
local function attributes(tvb, pos, astop)
  local out = {}
  while pos + 3 <= astop do
    local flags, code = tvb(pos, 1):uint(), tvb(pos + 1, 1):uint()
    local hdr = (bit.band(flags, 0x10) ~= 0) and 4 or 3
    if pos + hdr > astop then break end
    local n = hdr == 4 and tvb(pos + 2, 2):uint() or tvb(pos + 2, 1):uint()
    out[#out + 1] = { pos = pos, flags = flags, code = code, hdr = hdr, n = n }
    pos = pos + hdr + n
  end
  return out
end

-- The routes an MP_REACH_NLRI value announces (AFI, SAFI, next hop, reserved, NLRI).
local function mp_reach_routes(tvb, pos, stop, out)
  if pos + 5 > stop then return end
  local afi, nh = tvb(pos, 2):uint(), tvb(pos + 3, 1):uint()
  local at = pos + 4 + nh + 1
  if (afi == 1 or afi == 2) and at <= stop then prefixes(tvb, at, stop, afi, out) end
end

local function dissect_update(tvb, root)
  local size = tvb:len()
  if size < 23 or tvb(18, 1):uint() ~= 2 then return end
  local wlen = tvb(19, 2):uint()
  local apos = 21 + wlen
  if apos + 2 > size then return end
  local alen = tvb(apos, 2):uint()
  local astop = apos + 2 + alen
  if astop > size then return end
  local attrs = attributes(tvb, apos + 2, astop)
  local routes = prefixes(tvb, astop, size, 1, {})
  local route_range = tvb(astop, size - astop)
  for _, a in ipairs(attrs) do
    if a.code == MP_REACH_NLRI then
      local stop = math.min(a.pos + a.hdr + a.n, astop)
      mp_reach_routes(tvb, a.pos + a.hdr, stop, routes)
      if size == astop then route_range = tvb(a.pos, stop - a.pos) end
    end
  end
  local nlri = table.concat(routes, ", ")
  for _, a in ipairs(attrs) do
    if a.code == cats.prefs.type_code then
      local pos, hdr, n = a.pos, a.hdr, a.n
      local stop = math.min(pos + hdr + n, astop)
      local tree = root:add(cats, tvb(pos, stop - pos))
      tree:append_text(string.format(", %d bytes, route %s", n, nlri))
      local flags_item = tree:add(F.flags, tvb(pos, 1))
      if bit.band(a.flags, 0xC0) ~= 0xC0 then
        -- the codec refuses it (wire/attribute.py): the attribute is malformed
        flags_item:add_proto_expert_info(e_flags, string.format(
          "attribute flags 0x%02x lack optional+transitive (0xc0)", a.flags))
      end
      tree:add(F.partial, tvb(pos, 1))
      tree:add(F.extended, tvb(pos, 1))
      tree:add(F.type_code, tvb(pos + 1, 1))
      tree:add(F.length, tvb(pos + 2, hdr - 2))
      tree:add(F.nlri, route_range, nlri)
      if pos + hdr + n > astop then
        tree:add_proto_expert_info(e_overrun, "attribute length runs past the path attributes")
      end
      dissect_value(tvb, tree, pos + hdr, stop)
    end
  end
end

local f_bgp = Field.new("bgp")

function cats.dissector(tvb, pinfo, root)
  local found = false
  for _, fi in ipairs({ f_bgp() }) do
    local r = fi.range
    if r ~= nil and r:len() >= 19 then
      dissect_update(r:tvb(), root)
      found = true
    end
  end
  return found
end

register_postdissector(cats, true)
