//! Borrowed views of the wire `Value` and `Node` messages: what validation reads, with every
//! string borrowed. A `.pb` file's elements are decoded straight from the file buffer
//! ([`RawNode::decode`]), without the dozen small allocations per node that decoding into
//! `pb::Node` makes; an already decoded `pb::Node` (from `.json`) is viewed in place
//! ([`RawNode::of`]). Validation then has one conversion for both.
//!
//! Field numbers come from `wire::fields`, which the build writes from `graph.proto`. The
//! decoder follows protobuf's rules as prost applies them: fields in any order, the last
//! occurrence of a scalar wins, repeated fields append, packed and unpacked repeated numbers
//! are both accepted, a repeated embedded message merges, unknown fields are skipped, and a
//! known field with the wrong wire type or a string that is not UTF-8 is an error.
//! `ir/tests/view.rs` checks that both paths give the same graph.
//!
//! A view costs a bounded multiple of its element's bytes. An element over [`LARGE`] bytes
//! has its repeated fields counted first, so each list is allocated once at its size, and its
//! attributes (or a model's units and their intervals) stay encoded in the view, checked but
//! decoded again one at a time as they are converted: one node holding a million empty
//! attributes costs nothing like a million decoded attributes.

use prost::encoding::{decode_key, decode_varint, skip_field, DecodeContext, WireType};
use smallvec::SmallVec;

use crate::wire::{
    fields::{
        attribute, float_list, int_list, marker_interval, model, node, schema_facts, string_list,
        unit_intervals, value,
    },
    graph as pb,
};

/// Elements over this many bytes are decoded with their lists sized first and their
/// attributes left encoded; smaller ones cost a bounded amount each whatever they hold.
const LARGE: usize = 4096;

/// A wire `Value`, strings borrowed.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RawValue<'a> {
    pub name: &'a str,
    pub dtype: i32,
    pub shape: SmallVec<[i64; 4]>,
    pub role: i32,
}

/// A wire `Node`, strings borrowed; its module path and stack trace are checked but not kept
/// (nothing reads them).
#[derive(Debug, Clone, Default)]
pub(crate) struct RawNode<'a> {
    pub name: &'a str,
    pub op: &'a str,
    pub inputs: SmallVec<[&'a str; 4]>,
    pub outputs: SmallVec<[&'a str; 2]>,
    pub attributes: RawAttributes<'a>,
    pub phase: i32,
    pub model: &'a str,
    pub layer: Option<u32>,
    pub compiled_region: &'a str,
    pub micro_batch: u32,
    pub schema: RawSchema,
    pub python_releases: SmallVec<[&'a str; 2]>,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct RawSchema {
    pub mutates: SmallVec<[u32; 2]>,
    pub view_of: Option<u32>,
    pub random: bool,
    pub collective: i32,
}

/// A node's attributes: decoded, or (in a large node) still encoded.
#[derive(Debug, Clone)]
pub(crate) enum RawAttributes<'a> {
    Decoded(SmallVec<[RawAttribute<'a>; 2]>),
    /// The bytes of the node; its attributes are its fields 5, in order, already checked to
    /// decode.
    Encoded(&'a [u8]),
}

impl Default for RawAttributes<'_> {
    fn default() -> Self {
        RawAttributes::Decoded(SmallVec::new())
    }
}

impl<'a> RawAttributes<'a> {
    /// The attributes of a large node, decoded one at a time from its bytes. `RawNode::decode`
    /// decoded these very bytes: decoding them again cannot fail, and would only end the list
    /// if it could.
    pub fn encoded(bytes: &'a [u8]) -> impl Iterator<Item = RawAttribute<'a>> {
        fields_of(Reader::element(bytes), node::ATTRIBUTES)
            .map_while(|field| RawAttribute::decode(field.ok()?).ok())
    }
}

/// The fields numbered `tag` of the message `r` reads, as readers of their contents, in order;
/// an error ends them.
fn fields_of<'a>(
    mut r: Reader<'a>,
    tag: u32,
) -> impl Iterator<Item = Result<Reader<'a>, String>> + 'a {
    std::iter::from_fn(move || loop {
        match r.key() {
            Ok(None) => return None,
            Ok(Some((t, wire))) if t == tag => return Some(r.nested(wire)),
            Ok(Some((t, wire))) => {
                if let Err(e) = r.skip(wire, t) {
                    return Some(Err(e));
                }
            }
            Err(e) => return Some(Err(e)),
        }
    })
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RawAttribute<'a> {
    pub name: &'a str,
    pub value: Option<RawAttrValue<'a>>,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum RawAttrValue<'a> {
    Int(i64),
    Float(f64),
    Str(&'a str),
    Bool(bool),
    Ints(Vec<i64>),
    Floats(Vec<f64>),
    Strs(Vec<&'a str>),
}

impl<'a> RawValue<'a> {
    pub fn of(v: &'a pb::Value) -> Self {
        RawValue {
            name: &v.name,
            dtype: v.dtype,
            shape: SmallVec::from_slice(&v.shape),
            role: v.role,
        }
    }

    /// Decodes the bytes of one `Value` message.
    pub fn decode(bytes: &'a [u8]) -> Result<Self, String> {
        let mut raw = RawValue {
            name: "",
            dtype: 0,
            shape: SmallVec::new(),
            role: 0,
        };
        if bytes.len() > LARGE {
            raw.shape
                .reserve_exact(count_numbers(Reader::element(bytes), value::SHAPE)?);
        }
        let mut r = Reader::element_text(bytes);
        while let Some((tag, wire)) = r.key()? {
            match tag {
                value::NAME => raw.name = r.str(wire)?,
                value::DTYPE => raw.dtype = r.int32(wire)?,
                value::SHAPE => r.repeated_varints(wire, |v| raw.shape.push(v as i64))?,
                value::ROLE => raw.role = r.int32(wire)?,
                _ => r.skip(wire, tag)?,
            }
        }
        Ok(raw)
    }
}

impl<'a> RawNode<'a> {
    pub fn of(n: &'a pb::Node) -> Self {
        let schema = n
            .schema
            .as_ref()
            .map_or_else(RawSchema::default, |s| RawSchema {
                mutates: SmallVec::from_slice(&s.mutates),
                view_of: s.view_of,
                random: s.random,
                collective: s.collective,
            });
        RawNode {
            name: &n.name,
            op: &n.op,
            inputs: n.inputs.iter().map(String::as_str).collect(),
            outputs: n.outputs.iter().map(String::as_str).collect(),
            attributes: RawAttributes::Decoded(n.attributes.iter().map(RawAttribute::of).collect()),
            phase: n.phase,
            model: &n.model,
            layer: n.layer,
            compiled_region: &n.compiled_region,
            micro_batch: n.micro_batch,
            schema,
            python_releases: n.python_releases.iter().map(String::as_str).collect(),
        }
    }

    /// Decodes the bytes of one `Node` message.
    pub fn decode(bytes: &'a [u8]) -> Result<Self, String> {
        let mut raw = RawNode::default();
        if bytes.len() > LARGE {
            let [inputs, outputs] =
                count_fields(Reader::element(bytes), [node::INPUTS, node::OUTPUTS])?;
            raw.inputs.reserve_exact(inputs);
            raw.outputs.reserve_exact(outputs);
            raw.attributes = RawAttributes::Encoded(bytes);
        }
        let mut r = Reader::element_text(bytes);
        while let Some((tag, wire)) = r.key()? {
            match tag {
                node::NAME => raw.name = r.str(wire)?,
                node::OP => raw.op = r.str(wire)?,
                node::INPUTS => raw.inputs.push(r.str(wire)?),
                node::OUTPUTS => raw.outputs.push(r.str(wire)?),
                node::ATTRIBUTES => {
                    let attribute = RawAttribute::decode(r.nested(wire)?)?;
                    // A large node's attributes are only checked here.
                    if let RawAttributes::Decoded(attributes) = &mut raw.attributes {
                        attributes.push(attribute);
                    }
                }
                node::PHASE => raw.phase = r.int32(wire)?,
                node::MODEL => raw.model = r.str(wire)?,
                node::LAYER => raw.layer = Some(r.varint(wire)? as u32),
                // The module path and the stack trace are checked, not kept: nothing reads
                // them.
                node::MODULE_PATH | node::STACK_TRACE => drop(r.str(wire)?),
                node::COMPILED_REGION => raw.compiled_region = r.str(wire)?,
                node::MICRO_BATCH => raw.micro_batch = r.varint(wire)? as u32,
                node::SCHEMA => raw.schema.merge(r.nested(wire)?)?,
                node::PYTHON_RELEASES => raw.python_releases.push(r.str(wire)?),
                _ => r.skip(wire, tag)?,
            }
        }
        Ok(raw)
    }
}

/// How many fields of each of the `tags` the message `r` reads holds.
fn count_fields<const N: usize>(mut r: Reader<'_>, tags: [u32; N]) -> Result<[usize; N], String> {
    let mut counts = [0; N];
    while let Some((tag, wire)) = r.key()? {
        if let Some(i) = tags.iter().position(|&t| t == tag) {
            counts[i] += 1;
        }
        r.skip(wire, tag)?;
    }
    Ok(counts)
}

/// How many numbers the repeated varint field `tag` of the message `r` reads holds, packed or
/// not (in a packed run, every number ends with a byte below 0x80).
fn count_numbers(mut r: Reader<'_>, tag: u32) -> Result<usize, String> {
    let mut count = 0;
    while let Some((t, wire)) = r.key()? {
        match (t == tag, wire) {
            (true, WireType::LengthDelimited) => {
                count += r.message(wire)?.iter().filter(|&&b| b < 0x80).count();
            }
            (true, _) => {
                count += 1;
                r.skip(wire, t)?;
            }
            _ => r.skip(wire, t)?,
        }
    }
    Ok(count)
}

impl RawSchema {
    /// Merges one encoded `SchemaFacts` into `self`, as a repeated embedded message merges.
    fn merge(&mut self, mut r: Reader<'_>) -> Result<(), String> {
        while let Some((tag, wire)) = r.key()? {
            match tag {
                schema_facts::MUTATES => {
                    r.repeated_varints(wire, |v| self.mutates.push(v as u32))?
                }
                schema_facts::VIEW_OF => self.view_of = Some(r.varint(wire)? as u32),
                schema_facts::RANDOM => self.random = r.varint(wire)? != 0,
                schema_facts::COLLECTIVE => self.collective = r.int32(wire)?,
                _ => r.skip(wire, tag)?,
            }
        }
        Ok(())
    }
}

impl<'a> RawAttribute<'a> {
    fn of(a: &'a pb::Attribute) -> Self {
        use pb::attribute::Value as W;
        let value = a.value.as_ref().map(|v| match v {
            W::Int(i) => RawAttrValue::Int(*i),
            W::Float(f) => RawAttrValue::Float(*f),
            W::Str(s) => RawAttrValue::Str(s),
            W::Bool(b) => RawAttrValue::Bool(*b),
            W::Ints(l) => RawAttrValue::Ints(l.values.clone()),
            W::Floats(l) => RawAttrValue::Floats(l.values.clone()),
            W::Strs(l) => RawAttrValue::Strs(l.values.iter().map(String::as_str).collect()),
        });
        RawAttribute {
            name: &a.name,
            value,
        }
    }

    /// Decodes one `Attribute`. Of its `oneof`, the last field wins; a list field over a list
    /// already there takes more items into the same list, as prost merges it.
    fn decode(mut r: Reader<'a>) -> Result<Self, String> {
        let mut raw = RawAttribute {
            name: "",
            value: None,
        };
        while let Some((tag, wire)) = r.key()? {
            let value = &mut raw.value;
            match tag {
                attribute::NAME => raw.name = r.str(wire)?,
                attribute::INT => *value = Some(RawAttrValue::Int(r.varint(wire)? as i64)),
                attribute::FLOAT => {
                    *value = Some(RawAttrValue::Float(f64::from_bits(r.fixed64(wire)?)))
                }
                attribute::STR => *value = Some(RawAttrValue::Str(r.str(wire)?)),
                attribute::BOOL => *value = Some(RawAttrValue::Bool(r.varint(wire)? != 0)),
                // A list over the same kind of list merges into it; over anything else it
                // starts anew.
                attribute::INTS => {
                    let list = r.nested(wire)?;
                    let mut values = match value.take() {
                        Some(RawAttrValue::Ints(values)) => values,
                        _ => Vec::new(),
                    };
                    list_items(list, int_list::VALUES, |r, w| {
                        r.repeated_varints(w, |v| values.push(v as i64))
                    })?;
                    *value = Some(RawAttrValue::Ints(values));
                }
                attribute::FLOATS => {
                    let list = r.nested(wire)?;
                    let mut values = match value.take() {
                        Some(RawAttrValue::Floats(values)) => values,
                        _ => Vec::new(),
                    };
                    let mut push = |v| values.push(f64::from_bits(v));
                    list_items(list, float_list::VALUES, |r, w| {
                        r.repeated_fixed64(w, &mut push)
                    })?;
                    *value = Some(RawAttrValue::Floats(values));
                }
                attribute::STRS => {
                    let list = r.nested(wire)?;
                    let mut values = match value.take() {
                        Some(RawAttrValue::Strs(values)) => values,
                        _ => Vec::new(),
                    };
                    list_items(list, string_list::VALUES, |r, w| {
                        r.str(w).map(|v| values.push(v))
                    })?;
                    *value = Some(RawAttrValue::Strs(values));
                }
                _ => r.skip(wire, tag)?,
            }
        }
        Ok(raw)
    }
}

/// A wire `Model`, strings borrowed; its units are read one at a time.
#[derive(Debug, Clone)]
pub(crate) struct RawModel<'a> {
    pub name: &'a str,
    pub parent: &'a str,
    pub num_layers: u32,
    pub units: RawUnits<'a>,
}

/// A model's units, from a decoded message or still encoded (checked to decode).
#[derive(Debug, Clone)]
pub(crate) enum RawUnits<'a> {
    Decoded(&'a [pb::UnitIntervals]),
    /// The model's bytes and their nesting depth: its fields 4.
    Encoded(&'a [u8], u32),
}

/// One unit of a model and its intervals, read one at a time.
pub(crate) struct RawUnit<'a> {
    pub name: &'a str,
    pub intervals: RawIntervals<'a>,
}

#[derive(Debug, Clone)]
pub(crate) enum RawIntervals<'a> {
    Decoded(&'a [pb::MarkerInterval]),
    /// The unit's bytes and their nesting depth: its fields 2.
    Encoded(&'a [u8], u32),
}

impl<'a> RawModel<'a> {
    pub fn of(m: &'a pb::Model) -> Self {
        RawModel {
            name: &m.name,
            parent: &m.parent,
            num_layers: m.num_layers,
            units: RawUnits::Decoded(&m.units),
        }
    }

    /// Decodes the bytes of one `Model` message; its units and intervals are checked to
    /// decode, and left encoded.
    pub fn decode(bytes: &'a [u8]) -> Result<Self, String> {
        let mut raw = RawModel {
            name: "",
            parent: "",
            num_layers: 0,
            units: RawUnits::Encoded(bytes, ELEMENT_DEPTH),
        };
        let mut r = Reader::element(bytes);
        while let Some((tag, wire)) = r.key()? {
            match tag {
                model::NAME => raw.name = r.str(wire)?,
                model::PARENT => raw.parent = r.str(wire)?,
                model::NUM_LAYERS => raw.num_layers = r.varint(wire)? as u32,
                model::UNITS => RawUnit::check(r.nested(wire)?)?,
                _ => r.skip(wire, tag)?,
            }
        }
        Ok(raw)
    }
}

impl<'a> IntoIterator for RawUnits<'a> {
    type Item = RawUnit<'a>;
    type IntoIter = Box<dyn Iterator<Item = RawUnit<'a>> + 'a>;

    fn into_iter(self) -> Self::IntoIter {
        match self {
            RawUnits::Decoded(units) => Box::new(units.iter().map(|u| RawUnit {
                name: &u.unit,
                intervals: RawIntervals::Decoded(&u.intervals),
            })),
            // `RawModel::decode` decoded these bytes: decoding them again cannot fail.
            RawUnits::Encoded(model, depth) => Box::new(
                fields_of(
                    Reader {
                        buf: model,
                        depth,
                        text: "",
                    },
                    model::UNITS,
                )
                .map_while(|unit| RawUnit::decode(unit.ok()?).ok()),
            ),
        }
    }
}

impl<'a> RawUnit<'a> {
    /// Checks that a `UnitIntervals` and its intervals decode.
    fn check(r: Reader<'a>) -> Result<(), String> {
        let unit = RawUnit::decode(r.clone())?;
        let RawIntervals::Encoded(bytes, depth) = unit.intervals else {
            return Ok(());
        };
        let unit = Reader {
            buf: bytes,
            depth,
            text: "",
        };
        for interval in fields_of(unit, unit_intervals::INTERVALS) {
            decode_interval(interval?)?;
        }
        Ok(())
    }

    /// The unit's name (its last field 1); its intervals stay encoded.
    fn decode(mut r: Reader<'a>) -> Result<Self, String> {
        let unit_bytes = r.buf;
        let mut name = "";
        while let Some((tag, wire)) = r.key()? {
            match tag {
                unit_intervals::UNIT => name = r.str(wire)?,
                _ => r.skip(wire, tag)?,
            }
        }
        Ok(RawUnit {
            name,
            intervals: RawIntervals::Encoded(unit_bytes, r.depth),
        })
    }
}

impl<'a> IntoIterator for RawIntervals<'a> {
    /// An interval's begin and end markers.
    type Item = (&'a str, &'a str);
    type IntoIter = Box<dyn Iterator<Item = Self::Item> + 'a>;

    fn into_iter(self) -> Self::IntoIter {
        match self {
            RawIntervals::Decoded(intervals) => {
                Box::new(intervals.iter().map(|i| (i.begin.as_str(), i.end.as_str())))
            }
            // `RawUnit::check` decoded these bytes: decoding them again cannot fail.
            RawIntervals::Encoded(unit, depth) => Box::new(
                fields_of(
                    Reader {
                        buf: unit,
                        depth,
                        text: "",
                    },
                    unit_intervals::INTERVALS,
                )
                .map_while(|interval| decode_interval(interval.ok()?).ok()),
            ),
        }
    }
}

/// A `MarkerInterval`'s begin and end (the last of each).
fn decode_interval(mut r: Reader<'_>) -> Result<(&str, &str), String> {
    let (mut begin, mut end) = ("", "");
    while let Some((tag, wire)) = r.key()? {
        match tag {
            marker_interval::BEGIN => begin = r.str(wire)?,
            marker_interval::END => end = r.str(wire)?,
            _ => r.skip(wire, tag)?,
        }
    }
    Ok((begin, end))
}

/// Reads an `IntList`, `FloatList` or `StringList`: field `items` holds the items.
fn list_items<'a>(
    mut r: Reader<'a>,
    items: u32,
    mut item: impl FnMut(&mut Reader<'a>, WireType) -> Result<(), String>,
) -> Result<(), String> {
    while let Some((tag, wire)) = r.key()? {
        match tag {
            t if t == items => item(&mut r, wire)?,
            _ => r.skip(wire, tag)?,
        }
    }
    Ok(())
}

/// The unread rest of one message, and how many more levels of nesting prost would allow
/// inside it (its recursion limit counts down from 100 at the `Graph`).
#[derive(Clone)]
struct Reader<'a> {
    buf: &'a [u8],
    depth: u32,
    /// Text around `buf` already checked to be UTF-8 (see [`Reader::element_text`]): a string
    /// field inside it is not checked again.
    text: &'a str,
}

/// The nesting prost allows inside a value or node: one level below the `Graph` it decodes.
const ELEMENT_DEPTH: u32 = 99;

impl<'a> Reader<'a> {
    /// A `Value` or `Node` of a graph.
    fn element(buf: &'a [u8]) -> Self {
        Reader {
            buf,
            depth: ELEMENT_DEPTH,
            text: "",
        }
    }

    /// A `Value` or `Node` of a graph whose string fields are all read: the element's longest
    /// prefix that is UTF-8 is checked in one pass, which is a fraction of the cost of checking
    /// each short string alone. Keys, lengths and small numbers are ASCII, so in an exported
    /// graph the prefix runs to the first number over 127 (a layer index, a dimension), and
    /// mostly holds every name of the element.
    fn element_text(buf: &'a [u8]) -> Self {
        let text = match std::str::from_utf8(buf) {
            Ok(text) => text,
            Err(e) => buf
                .get(..e.valid_up_to())
                .and_then(|prefix| std::str::from_utf8(prefix).ok())
                .unwrap_or_default(),
        };
        Reader {
            text,
            ..Reader::element(buf)
        }
    }

    /// The next field's tag and wire type, or `None` at the end.
    fn key(&mut self) -> Result<Option<(u32, WireType)>, String> {
        if self.buf.is_empty() {
            return Ok(None);
        }
        read_key(&mut self.buf).map(Some)
    }

    /// Skips an unknown field; groups nest, and count against the recursion limit.
    fn skip(&mut self, wire: WireType, tag: u32) -> Result<(), String> {
        skip_nested(&mut self.buf, wire, tag, self.depth)
    }

    /// An embedded message field, read one level deeper.
    fn nested(&mut self, wire: WireType) -> Result<Reader<'a>, String> {
        let depth = self.depth.checked_sub(1).ok_or_else(recursion_limit)?;
        Ok(Reader {
            buf: self.message(wire)?,
            depth,
            text: self.text,
        })
    }

    fn raw_varint(&mut self) -> Result<u64, String> {
        read_varint(&mut self.buf)
    }

    fn varint(&mut self, wire: WireType) -> Result<u64, String> {
        expect(wire, WireType::Varint)?;
        self.raw_varint()
    }

    /// An `int32` or enum: the varint truncated, as protobuf specifies.
    fn int32(&mut self, wire: WireType) -> Result<i32, String> {
        Ok(self.varint(wire)? as i32)
    }

    fn fixed64(&mut self, wire: WireType) -> Result<u64, String> {
        expect(wire, WireType::SixtyFourBit)?;
        self.raw_fixed64()
    }

    fn raw_fixed64(&mut self) -> Result<u64, String> {
        match self.buf.split_first_chunk::<8>() {
            Some((bytes, rest)) => {
                self.buf = rest;
                Ok(u64::from_le_bytes(*bytes))
            }
            None => Err(truncated()),
        }
    }

    /// A length-delimited field's bytes.
    #[inline]
    fn message(&mut self, wire: WireType) -> Result<&'a [u8], String> {
        expect(wire, WireType::LengthDelimited)?;
        let len = self.raw_varint()?;
        match usize::try_from(len) {
            Ok(len) if len <= self.buf.len() => {
                let (bytes, rest) = self.buf.split_at(len);
                self.buf = rest;
                Ok(bytes)
            }
            _ => Err(truncated()),
        }
    }

    #[inline]
    fn str(&mut self, wire: WireType) -> Result<&'a str, String> {
        let bytes = self.message(wire)?;
        match checked_text(self.text, bytes) {
            Some(text) => Ok(text),
            None => std::str::from_utf8(bytes).map_err(|_| not_utf8()),
        }
    }

    /// A repeated varint field, packed or not.
    fn repeated_varints(&mut self, wire: WireType, push: impl FnMut(u64)) -> Result<(), String> {
        self.repeated(wire, WireType::Varint, Reader::raw_varint, push)
    }

    /// A repeated 64-bit field, packed or not.
    fn repeated_fixed64(&mut self, wire: WireType, push: impl FnMut(u64)) -> Result<(), String> {
        self.repeated(wire, WireType::SixtyFourBit, Reader::raw_fixed64, push)
    }

    /// A repeated number field, packed (one length-delimited run of elements) or not (one
    /// field of wire type `single` per element); `read` reads one element.
    fn repeated(
        &mut self,
        wire: WireType,
        single: WireType,
        read: fn(&mut Reader<'a>) -> Result<u64, String>,
        mut push: impl FnMut(u64),
    ) -> Result<(), String> {
        if wire != WireType::LengthDelimited {
            expect(wire, single)?;
            push(read(self)?);
            return Ok(());
        }
        let mut packed = Reader {
            buf: self.message(wire)?,
            ..self.clone()
        };
        while !packed.buf.is_empty() {
            push(read(&mut packed)?);
        }
        Ok(())
    }
}

/// prost's `decode_key` over a byte slice, with a one-byte key (fields 1 to 15) read in
/// place: a million-node file holds ten million keys. Anything else, errors included, is
/// prost's.
#[inline]
pub(crate) fn read_key(buf: &mut &[u8]) -> Result<(u32, WireType), String> {
    if let Some((&byte, rest)) = buf.split_first() {
        let wire = WireType::try_from(u64::from(byte & 0x07));
        if let (true, 1.., Ok(wire)) = (byte < 0x80, byte >> 3, wire) {
            *buf = rest;
            return Ok((u32::from(byte >> 3), wire));
        }
    }
    decode_key_slowly(buf)
}

#[cold]
#[inline(never)]
fn decode_key_slowly(buf: &mut &[u8]) -> Result<(u32, WireType), String> {
    decode_key(buf).map_err(|e| e.to_string())
}

/// prost's `decode_varint` over a byte slice, with a one-byte varint read in place.
#[inline]
pub(crate) fn read_varint(buf: &mut &[u8]) -> Result<u64, String> {
    match buf.split_first() {
        Some((&byte, rest)) if byte < 0x80 => {
            *buf = rest;
            Ok(u64::from(byte))
        }
        _ => decode_varint_slowly(buf),
    }
}

#[inline(never)]
fn decode_varint_slowly(buf: &mut &[u8]) -> Result<u64, String> {
    decode_varint(buf).map_err(|e| e.to_string())
}

/// `bytes` as a part of `text`, when they lie inside it at character boundaries: then they
/// are UTF-8 without another look.
#[inline]
fn checked_text<'a>(text: &'a str, bytes: &[u8]) -> Option<&'a str> {
    let start = (bytes.as_ptr() as usize).checked_sub(text.as_ptr() as usize)?;
    text.get(start..start.checked_add(bytes.len())?)
}

#[inline]
fn expect(wire: WireType, expected: WireType) -> Result<(), String> {
    if wire == expected {
        return Ok(());
    }
    Err(wrong_wire_type(wire, expected))
}

// The messages of broken input are made out of line, so that the readers of valid input
// inline into their callers.

#[cold]
fn wrong_wire_type(wire: WireType, expected: WireType) -> String {
    format!("invalid wire type: {wire:?} (expected {expected:?})")
}

#[cold]
fn not_utf8() -> String {
    "invalid string value: data is not UTF-8 encoded".to_owned()
}

/// prost's `skip_field` with the recursion limit counted from `depth`: every field needs one
/// level left, and each group nested inside takes one.
fn skip_nested(buf: &mut &[u8], wire: WireType, tag: u32, depth: u32) -> Result<(), String> {
    if depth == 0 {
        return Err(recursion_limit());
    }
    if wire != WireType::StartGroup {
        return skip_field(wire, tag, buf, DecodeContext::default()).map_err(|e| e.to_string());
    }
    loop {
        let (inner_tag, inner_wire) = read_key(buf)?;
        if inner_wire == WireType::EndGroup {
            if inner_tag != tag {
                return Err("unexpected end group tag".to_owned());
            }
            return Ok(());
        }
        skip_nested(buf, inner_wire, inner_tag, depth - 1)?;
    }
}

#[cold]
fn recursion_limit() -> String {
    "recursion limit reached".to_owned()
}

#[cold]
fn truncated() -> String {
    "buffer underflow".to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every input of up to two bytes (and each followed by more), read by the fast readers and
    /// by prost: the same key or number, the same bytes left, or an error from both.
    #[test]
    fn keys_and_varints_read_as_prost_reads_them() {
        let short = (0..=u8::MAX).map(|b| vec![b]);
        let pairs = (0..=u8::MAX).flat_map(|a| (0..=u8::MAX).map(move |b| vec![a, b]));
        for input in std::iter::once(Vec::new()).chain(short).chain(pairs) {
            let (mut fast, mut reference) = (input.as_slice(), input.as_slice());
            let key = read_key(&mut fast);
            let expected = decode_key(&mut reference).map_err(|e| e.to_string());
            assert_eq!(key, expected, "key {input:?}");
            if key.is_ok() {
                assert_eq!(fast, reference, "rest after key {input:?}");
            }
            let (mut fast, mut reference) = (input.as_slice(), input.as_slice());
            let number = read_varint(&mut fast);
            let expected = decode_varint(&mut reference).map_err(|e| e.to_string());
            assert_eq!(number, expected, "varint {input:?}");
            if number.is_ok() {
                assert_eq!(fast, reference, "rest after varint {input:?}");
            }
        }
    }
}
