-- catsproto.lua: Wireshark/tshark dissector for the catsproto cache-state BGP path attribute.
--
-- Wireshark's BGP dissector shows an unassigned attribute type (255 here) as "Unknown"
-- and refuses BGP messages over 4096 bytes (RFC 8654 extended messages), although it
-- still reassembles them over TCP. So this is a post-dissector: for every BGP message
-- the BGP dissector framed (its "bgp" protocol item spans the whole message), it walks
-- the UPDATE itself, finds the path attributes of our type code (a preference, 255 by
-- default; the Partial and Extended-Length bits are honoured, the rest ignored) and
-- shows every TLV and field under a "catsproto" tree. Field names follow the codec:
-- catsproto.<tlv>.<field>, e.g. catsproto.origin.cs_id, catsproto.cache_summaries.tier.
-- The layouts below mirror catsproto/wire/tlvs.py; tests/test_dissector.py checks the
-- fields against the codec on a real capture. Lenient like a viewer: a length that
-- overruns its window is flagged (expert info) and the rest of that TLV shown as bytes.
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
  [16] = "metrics-l0", [17] = "metrics-l1", [18] = "metrics-l2",
  [32] = "cache-model", [33] = "cache-summaries", [34] = "capacity",
  [35] = "hot-prefixes", [36] = "sealed-cache", [254] = "delegation", [255] = "signature",
})
local ENUMS = {
  tier = { [1] = "hbm", [2] = "dram", [3] = "ssd", [4] = "remote" },
  kind = { [1] = "exact", [2] = "bloom", [3] = "fuse", [4] = "delta" },
  key_scheme = { [1] = "blake2b64-chained" },
  category = { [1] = "compute", [2] = "communication", [3] = "service", [4] = "composed" },
  unit = { [1] = "count", [2] = "percent", [3] = "milliseconds", [4] = "microseconds",
           [5] = "bits-per-second", [6] = "bytes", [7] = "tokens-per-second",
           [8] = "requests-per-second" },
  statistic = { [1] = "current", [2] = "mean", [3] = "min", [4] = "max", [5] = "p50",
                [6] = "p95", [7] = "p99" },
  source = { [1] = "nominal", [2] = "measured", [3] = "estimated", [4] = "aggregated" },
  signature_algorithm = { [1] = "ed25519" },
  aead = { [1] = "chacha20-poly1305" },
  scope_kind = { [1] = "cs-id", [2] = "route", [3] = "address" },
  metric_type = { [1] = "gpu-utilization", [2] = "running-requests", [3] = "waiting-requests",
                  [4] = "prefill-throughput", [5] = "decode-throughput",
                  [6] = "kv-cache-utilization", [7] = "ttft", [8] = "inter-token-latency",
                  [9] = "network-delay", [10] = "network-bandwidth" },
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

local L0 = { { "metric_type", "enum16", names = "metric_type" }, { "unit", "enum8", names = "unit" },
             { "statistic", "enum8", names = "statistic" }, { "source", "enum8", names = "source" },
             { "value", "f64" } }
local ENTRY = { { "tier", "enum8", names = "tier" }, { "kind", "enum8", names = "kind" },
                { "version", "u32" }, { "base_version", "u32" },
                { "key_lo", "u64", hex = true }, { "key_hi", "u64", hex = true },
                { "entry_count", "u32" }, { "bytes_per_block", "u32" },
                { "fetch_latency_us", "u32" }, { "fetch_bandwidth_mbps", "u32" },
                { "params", "blob8" }, { "body", "rest" } }
local SCOPE = { { "kind", "enum8", names = "scope_kind" }, { "value", "blob8" } }

-- TLV type -> { field-name prefix, layout }
local LAYOUTS = {
  [1] = { "version", { { "version", "u8" } } },
  [2] = { "origin", { { "cs_id", "u32" }, { "site_id", "u32" }, { "address", "address" } } },
  [3] = { "sequence", { { "epoch", "u32" }, { "sequence", "u64" } } },
  [4] = { "timestamp", { { "ms", "u64" } } },
  [16] = { "metrics_l0", { { "metrics", "items", item = L0 } } },
  [17] = { "metrics_l1", { { "scores", "items", item = {
    { "category", "enum8", names = "category" }, { "score", "u8" } } } } },
  [18] = { "metrics_l2", { { "score", "u8" } } },
  [32] = { "cache_model", { { "model_id", "text8" }, { "block_size", "u32" },
                            { "key_scheme", "enum8", names = "key_scheme" }, { "secret_id", "u32" } } },
  [33] = { "cache_summaries", { { "entries", "items", prefix = 2, item = ENTRY } } },
  [34] = { "capacity", { { "free_blocks", "u64" }, { "total_blocks", "u64" } } },
  [35] = { "hot_prefixes", { { "prefixes", "items", item = {
    { "block_key", "u64", hex = true }, { "depth", "u32" } } } } },
  [36] = { "sealed_cache", { { "algorithm", "enum8", names = "aead" }, { "key_id", "u32" },
                             { "nonce", "blob8" }, { "ciphertext", "rest" } } },
  [254] = { "delegation", { { "algorithm", "enum8", names = "signature_algorithm" },
                            { "operator_key_id", "blob8" }, { "node_key", "blob8" },
                            { "not_before_ms", "u64" }, { "not_after_ms", "u64" },
                            { "operator_signature", "blob8" },
                            { "scope", "items", item = SCOPE } } },
  [255] = { "signature", { { "algorithm", "enum8", names = "signature_algorithm" },
                           { "key_id", "blob8" }, { "signature", "rest" } } },
}
for _, l in pairs(LAYOUTS) do declare(l[1], l[2]) end
field("unknown.value", ProtoField.bytes("catsproto.unknown.value", "Value"))

local e_overrun = ProtoExpert.new("catsproto.overrun", "Field runs past its TLV",
                                  expert.group.MALFORMED, expert.severity.ERROR)
local e_left = ProtoExpert.new("catsproto.unread", "Bytes left unread in the TLV",
                               expert.group.MALFORMED, expert.severity.WARN)
cats.fields = fields
cats.experts = { e_overrun, e_left }

-- ---- the layout interpreter --------------------------------------------------------------
local WIDTH = { u8 = 1, u16 = 2, u32 = 4, u64 = 8, f64 = 8, enum8 = 1, enum16 = 2 }

-- Dissect `layout` in tvb[pos, stop); returns the position reached, or nil on overrun.
local function run(tvb, tree, prefix, layout, pos, stop)
  for _, f in ipairs(layout) do
    local name, kind = f[1], f[2]
    local abbrev = prefix .. "." .. name
    local w = WIDTH[kind]
    if w then
      if pos + w > stop then return nil end
      tree:add(F[abbrev], tvb(pos, w))
      pos = pos + w
    elseif kind == "blob8" or kind == "text8" then
      if pos + 1 > stop then return nil end
      local n = tvb(pos, 1):uint()
      tree:add(F[abbrev .. "_len"], tvb(pos, 1))
      if pos + 1 + n > stop then return nil end
      if n > 0 then tree:add(F[abbrev], tvb(pos + 1, n)) end
      pos = pos + 1 + n
    elseif kind == "rest" then
      if stop > pos then tree:add(F[abbrev], tvb(pos, stop - pos)) end
      pos = stop
    elseif kind == "address" then
      if pos + 2 > stop then return nil end
      local afi = tvb(pos, 2):uint()
      tree:add(F[abbrev .. ".afi"], tvb(pos, 2))
      local n = (afi == 1 and 4) or (afi == 2 and 16) or nil
      if n == nil or pos + 2 + n > stop then return nil end
      tree:add(afi == 1 and F[abbrev] or F[abbrev .. "6"], tvb(pos + 2, n))
      pos = pos + 2 + n
    elseif kind == "items" then
      local index = 0
      while pos < stop do
        local istop = stop
        local start = pos
        if f.prefix == 2 then
          if pos + 2 > stop then return nil end
          istop = pos + 2 + tvb(pos, 2):uint()
          if istop > stop then return nil end
          pos = pos + 2
        end
        local sub = tree:add(F[abbrev], tvb(start, 0))
        sub:set_text(string.format("%s[%d]", name, index))
        if f.prefix == 2 then sub:add(F.item_length, tvb(start, 2)) end
        local reached = run(tvb, sub, prefix, f.item, pos, istop)
        if reached == nil then return nil end
        if f.prefix == 2 and reached ~= istop then return nil end
        sub:set_len(reached - start)
        pos = reached
        index = index + 1
      end
    end
  end
  return pos
end

local function dissect_value(tvb, tree, pos, stop)
  while pos < stop do
    if pos + 4 > stop then
      tree:add_proto_expert_info(e_overrun, "truncated TLV header")
      return
    end
    local t, n = tvb(pos, 2):uint(), tvb(pos + 2, 2):uint()
    local tlv_stop = pos + 4 + n
    local tlv = tree:add(F.tlv, tvb(pos, math.min(4 + n, stop - pos)))
    tlv:set_text(string.format("TLV %s (%d), %d bytes", TLV_NAMES[t] or "unknown", t, n))
    tlv:add(F.tlv_type, tvb(pos, 2))
    tlv:add(F.tlv_length, tvb(pos + 2, 2))
    if tlv_stop > stop then
      tlv:add_proto_expert_info(e_overrun, string.format(
        "TLV length %d exceeds the %d bytes left in the attribute", n, stop - pos - 4))
      return
    end
    local layout = LAYOUTS[t]
    if layout == nil then
      if n > 0 then tlv:add(F["unknown.value"], tvb(pos + 4, n)) end
    else
      local reached = run(tvb, tlv, layout[1], layout[2], pos + 4, tlv_stop)
      if reached == nil then
        tlv:add_proto_expert_info(e_overrun)
      elseif reached < tlv_stop then
        tlv:add_proto_expert_info(e_left, string.format("%d bytes unread", tlv_stop - reached))
      end
    end
    pos = tlv_stop
  end
end

-- ---- BGP framing: find our attribute in each UPDATE --------------------------------------
local function prefixes(tvb, pos, stop)
  local out = {}
  while pos < stop do
    local bits = tvb(pos, 1):uint()
    local n = math.floor((bits + 7) / 8)
    if bits > 32 or pos + 1 + n > stop then break end
    local o = { 0, 0, 0, 0 }
    for i = 1, n do o[i] = tvb(pos + i, 1):uint() end
    out[#out + 1] = string.format("%d.%d.%d.%d/%d", o[1], o[2], o[3], o[4], bits)
    pos = pos + 1 + n
  end
  return out
end

local function dissect_update(tvb, root)
  local size = tvb:len()
  if size < 23 or tvb(18, 1):uint() ~= 2 then return end
  local wlen = tvb(19, 2):uint()
  local apos = 21 + wlen
  if apos + 2 > size then return end
  local alen = tvb(apos, 2):uint()
  local pos, astop = apos + 2, apos + 2 + alen
  if astop > size then return end
  local nlri = table.concat(prefixes(tvb, astop, size), ", ")
  while pos + 3 <= astop do
    local flags, code = tvb(pos, 1):uint(), tvb(pos + 1, 1):uint()
    local hdr = (bit.band(flags, 0x10) ~= 0) and 4 or 3
    if pos + hdr > astop then return end
    local n = hdr == 4 and tvb(pos + 2, 2):uint() or tvb(pos + 2, 1):uint()
    local stop = math.min(pos + hdr + n, astop)
    if code == cats.prefs.type_code then
      local tree = root:add(cats, tvb(pos, stop - pos))
      tree:append_text(string.format(", %d bytes, route %s", n, nlri))
      tree:add(F.flags, tvb(pos, 1))
      tree:add(F.partial, tvb(pos, 1))
      tree:add(F.extended, tvb(pos, 1))
      tree:add(F.type_code, tvb(pos + 1, 1))
      tree:add(F.length, tvb(pos + 2, hdr - 2))
      tree:add(F.nlri, tvb(astop, size - astop), nlri)
      if pos + hdr + n > astop then
        tree:add_proto_expert_info(e_overrun, "attribute length runs past the path attributes")
      end
      dissect_value(tvb, tree, pos + hdr, stop)
    end
    pos = pos + hdr + n
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
