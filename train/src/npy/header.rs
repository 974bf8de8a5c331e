//! NumPy's `.npy` header (format 1.0/2.0): the dtype descriptor, the
//! order and the shape, read from a Python dict literal and written padded.

/// A C-order `.npy` file's dtype descriptor, shape and data bytes.
pub(super) fn split(bytes: &[u8]) -> std::result::Result<(String, Vec<usize>, &[u8]), String> {
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err("not an .npy file".into());
    }
    let (header_len, start): (usize, usize) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
        v => return Err(format!("unsupported .npy version {v}")),
    };
    let end = start.checked_add(header_len).ok_or("header length overflows")?;
    let header = bytes.get(start..end).ok_or("truncated header")?;
    if !header.is_ascii() {
        return Err("the header is not ASCII".into());
    }
    let header = std::str::from_utf8(header).map_err(|_| "the header is not text")?;
    let dict = header_dict(header)?;
    let get =
        |key: &str| dict.iter().find(|(k, _)| k == key).map(|(_, v)| v).ok_or(format!("the header has no '{key}'"));
    let descr = match get("descr")? {
        Value::Str(d) => d.clone(),
        other => return Err(format!("descr must be a string, found {other}")),
    };
    match get("fortran_order")? {
        Value::Bool(false) => {}
        Value::Bool(true) => return Err("Fortran-order arrays are not supported".into()),
        other => return Err(format!("fortran_order must be True or False, found {other}")),
    }
    let shape = match get("shape")? {
        Value::Tuple(dims) => dims.clone(),
        other => return Err(format!("shape must be a tuple of integers, found {other}")),
    };
    Ok((descr, shape, &bytes[end..]))
}

/// A value of the header's Python dict literal.
#[derive(Clone, Debug, PartialEq)]
enum Value {
    Str(String),
    Bool(bool),
    Tuple(Vec<usize>),
}

impl std::fmt::Display for Value {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Value::Str(s) => write!(f, "'{s}'"),
            Value::Bool(b) => f.write_str(if *b { "True" } else { "False" }),
            Value::Tuple(t) => write!(f, "{t:?}"),
        }
    }
}

/// Parses the header: `{'key': value, ...}` with string, boolean and
/// integer-tuple values (what NumPy writes), and nothing else.
fn header_dict(text: &str) -> std::result::Result<Vec<(String, Value)>, String> {
    let b = text.trim().as_bytes();
    let mut i = 0;
    let skip = |i: &mut usize| {
        while *i < b.len() && b[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    let expect = |i: &mut usize, c: u8| -> std::result::Result<(), String> {
        if b.get(*i) == Some(&c) {
            *i += 1;
            Ok(())
        } else {
            Err(format!("malformed header: expected `{}` at byte {i}", c as char))
        }
    };
    let string = |i: &mut usize| -> std::result::Result<String, String> {
        let quote = *b.get(*i).ok_or("malformed header: unexpected end")?;
        if quote != b'\'' && quote != b'"' {
            return Err(format!("malformed header: expected a string at byte {i}"));
        }
        let from = *i + 1;
        let len = b[from..].iter().position(|c| *c == quote).ok_or("malformed header: unterminated string")?;
        *i = from + len + 1;
        Ok(String::from_utf8_lossy(&b[from..from + len]).into_owned())
    };
    expect(&mut i, b'{')?;
    let mut out = Vec::new();
    loop {
        skip(&mut i);
        if b.get(i) == Some(&b'}') {
            break;
        }
        let key = string(&mut i)?;
        skip(&mut i);
        expect(&mut i, b':')?;
        skip(&mut i);
        let value = match b.get(i) {
            Some(b'\'') | Some(b'"') => Value::Str(string(&mut i)?),
            Some(b'T') if b[i..].starts_with(b"True") => {
                i += 4;
                Value::Bool(true)
            }
            Some(b'F') if b[i..].starts_with(b"False") => {
                i += 5;
                Value::Bool(false)
            }
            Some(b'(') => {
                i += 1;
                let mut dims = Vec::new();
                loop {
                    skip(&mut i);
                    if b.get(i) == Some(&b')') {
                        i += 1;
                        break;
                    }
                    let from = i;
                    while i < b.len() && b[i].is_ascii_digit() {
                        i += 1;
                    }
                    if from == i {
                        return Err(format!("malformed shape: expected a dimension at byte {from}"));
                    }
                    let digits = std::str::from_utf8(&b[from..i]).map_err(|_| "malformed shape")?;
                    dims.push(digits.parse::<usize>().map_err(|_| format!("dimension {digits} is too large"))?);
                    skip(&mut i);
                    match b.get(i) {
                        Some(b',') => i += 1,
                        Some(b')') => {}
                        _ => return Err(format!("malformed shape: expected `,` or `)` at byte {i}")),
                    }
                }
                Value::Tuple(dims)
            }
            _ => return Err(format!("malformed header: unexpected value at byte {i}")),
        };
        out.push((key, value));
        skip(&mut i);
        match b.get(i) {
            Some(b',') => i += 1,
            Some(b'}') => {}
            _ => return Err(format!("malformed header: expected `,` or `}}` at byte {i}")),
        }
    }
    Ok(out)
}

/// The header (format 1.0, padded to a multiple of 64 bytes) of an array of
/// NumPy type `descr` and `shape`.
pub(super) fn header_of(descr: &str, shape: &[usize]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_text = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape_text}, }}");
    // Magic (6) + version (2) + length (2) + header + newline, padded to 64 bytes.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out
}

pub(super) fn numel(shape: &[usize]) -> std::result::Result<usize, String> {
    shape.iter().try_fold(1usize, |a, d| a.checked_mul(*d)).ok_or(format!("shape {shape:?} has too many elements"))
}
