//! gRPC over HTTP/2 for the EPP's event loop, without I/O of its own (sans-IO).
//!
//! Why native: the EPP serves ext-proc on its asyncio loop (`epp/server/h2.py`), and with
//! the pure-Python `h2` state machine a third of its CPU per request was HTTP/2 framing,
//! HPACK and frame objects (docs/architecture.md, "The ext-proc transport"). Here the `h2`
//! crate does that work: Python hands in the bytes its transport read, gets back the gRPC
//! events they complete, and takes out the bytes to write. No thread, no runtime: every
//! future is polled in place, from the caller's thread, under the GIL.
//!
//! How the polling works. The connection reads from an in-memory buffer that answers
//! "pending" when empty, and writes into another. After new bytes arrive, or after an
//! answer is queued, `drive` polls the connection until it is pending (which parses every
//! complete frame and writes out every frame it can), then polls the streams that the
//! connection woke: each stream has its own waker, which records the stream's id, so a
//! drive touches only streams with something new rather than every open one.
//!
//! gRPC on top: length-prefixed messages (1 byte compressed flag, 4 bytes big-endian
//! length), response headers `:status 200` / `content-type: application/grpc`, trailers
//! `grpc-status` / `grpc-message`, and trailers-only answers for a stream that ends before
//! any message. Flow control: every received byte is released at once (the EPP's own
//! limits bound what a stream may hold); sends are buffered by `h2` until the peer's
//! windows allow them. What the connection holds beyond Python's sight, partial messages
//! received and answers queued to send, is counted (`buffered`): the EPP charges it to
//! its body budget, since an echoed body leaves that budget when it is routed but stays
//! in memory until the peer's windows let it out.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use h2::server::{Builder, Connection, Handshake, SendResponse};
use h2::{RecvStream, SendStream};
use http::{HeaderMap, HeaderValue, Response};
use pyo3::exceptions::{PyConnectionError, PyValueError};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::PyBytes;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Event kinds handed to Python: a new stream (payload: its `:path`), a complete message,
/// the peer's half-close, the stream gone (reset, or the peer's error), and a message the
/// stream cannot take (payload: why): over the size limit, or compressed.
const NEW: u8 = 0;
const MESSAGE: u8 = 1;
const END: u8 = 2;
const CLOSED: u8 = 3;
const TOO_LARGE: u8 = 4;
const COMPRESSED: u8 = 5;

/// What was read and not yet parsed (the Python bytes objects themselves, not copies:
/// a 220 KB request body would otherwise be copied once more), and what to write.
#[derive(Default)]
struct Buffers {
    inbound: VecDeque<Bytes>,
    outbound: Vec<u8>,
    /// Bytes the connection may still read before the streams it opened are accepted
    /// (`Inner::drive` renews it each round; see `Limits`).
    budget: usize,
}

impl Buffers {
    /// Input is waiting that this round's budget did not let the connection read.
    fn held_back(&self) -> bool {
        self.budget == 0 && !self.inbound.is_empty()
    }
}

/// The fewest bytes a peer can open a stream and reset it with: a HEADERS frame (9 bytes
/// of frame header, 3 of HPACK when `:method`, `:scheme` and `:path` are indexed) and a
/// RST_STREAM frame (9 + 4).
const MIN_OPEN_AND_RESET: usize = 25;

/// The HTTP/2 limits, all derived from one number: the streams Envoy may hold open on
/// the connection (`concurrency`, our SETTINGS_MAX_CONCURRENT_STREAMS; Envoy's own cap,
/// `grpc_protocol_options` in infergate/envoy/bootstrap.py, is higher).
///
/// Envoy is a trusted multiplexer: each ext-proc stream is one client request, and a
/// client that goes away makes Envoy reset its stream (RST_STREAM CANCEL), often in the
/// same read as the stream's HEADERS. The `h2` crate's defaults are for untrusted peers:
/// more than 20 streams reset before the server accepted them, or 1024 streams the
/// server reset for a peer's error over the connection's life, and it sends GOAWAY
/// ENHANCE_YOUR_CALM, failing every stream on the connection, other clients' included
/// (200 client aborts in a burst did it). So:
///
/// * `pending_accept_resets = concurrency`, and the connection reads at most
///   `read_slice = (concurrency - 1) * MIN_OPEN_AND_RESET` bytes before `drive` accepts
///   every stream it opened (accepting one takes it off h2's count). A round then holds
///   at most `read_slice / MIN_OPEN_AND_RESET` complete openings plus one begun in the
///   previous round: `concurrency`, never more than the limit, whatever the peer sends.
///   The accept queue's memory stays bounded as h2 intends (one round's streams).
/// * `local_error_resets = concurrency` (h2's default if larger): h2 never forgets
///   this count, so it is a budget for the connection's life; every stream Envoy may
///   hold open may earn one reset for a protocol error before the connection is judged
///   broken (Envoy makes none in normal operation; it reconnects if it must).
/// * `remembered_resets = concurrency`: streams reset on our side are remembered so that
///   the frames Envoy had already sent on them are ignored, not taken for errors; all
///   of Envoy's open streams may be reset at once.
///
/// With the EPP's default 10,000 streams (+1,000 for its own 503s) the read slice is
/// about 275 KB, more than one socket read (uvloop reads up to 256 KiB): the rounds cost
/// nothing in the common case.
struct Limits {
    concurrency: u32,
    pending_accept_resets: usize,
    local_error_resets: usize,
    remembered_resets: usize,
    read_slice: usize,
}

impl Limits {
    fn for_concurrency(concurrency: u32) -> PyResult<Self> {
        if concurrency < 2 {
            return Err(PyValueError::new_err(
                "max_concurrent_streams must be at least 2",
            ));
        }
        let streams = concurrency as usize;
        Ok(Self {
            concurrency,
            pending_accept_resets: streams,
            local_error_resets: streams.max(1024),
            remembered_resets: streams,
            read_slice: (streams - 1) * MIN_OPEN_AND_RESET,
        })
    }
}

/// The connection's I/O: reads what Python handed in, writes what Python takes out.
struct Io(Arc<Mutex<Buffers>>);

impl AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let mut buffers = self.0.lock().expect("buffers");
        let budget = buffers.budget;
        let Some(front) = buffers.inbound.front_mut().filter(|_| budget > 0) else {
            return Poll::Pending; // the next `receive`, or the drive's next round, polls again
        };
        let n = buf.remaining().min(front.len()).min(budget);
        buf.put_slice(&front[..n]);
        front.advance(n);
        if front.is_empty() {
            buffers.inbound.pop_front();
        }
        buffers.budget -= n;
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Io {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.0
            .lock()
            .expect("buffers")
            .outbound
            .extend_from_slice(data);
        Poll::Ready(Ok(data.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// An answer's bytes queued in `h2`, counted until written out (or dropped with a reset
/// stream): `queued` is what the connection still holds to send. Why: `h2` buffers a
/// send whole until the peer's windows take it, and Envoy's windows on an echoed body
/// open only as fast as its upstream reads; uncounted, 70 bodies of 8 MiB sat there
/// (docs/benchmarks/resilience.md, "Memory under a flood").
struct Counted {
    bytes: Bytes,
    queued: Arc<AtomicUsize>,
}

impl Counted {
    fn new(bytes: Bytes, queued: &Arc<AtomicUsize>) -> Self {
        queued.fetch_add(bytes.len(), Ordering::Relaxed);
        Self {
            bytes,
            queued: queued.clone(),
        }
    }
}

impl Buf for Counted {
    fn remaining(&self) -> usize {
        self.bytes.len()
    }

    fn chunk(&self) -> &[u8] {
        &self.bytes
    }

    fn advance(&mut self, cnt: usize) {
        self.bytes.advance(cnt);
        self.queued.fetch_sub(cnt, Ordering::Relaxed);
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.queued.fetch_sub(self.bytes.len(), Ordering::Relaxed);
    }
}

/// A stream's waker: records the stream's id, so the next drive polls it.
struct StreamWake {
    id: u32,
    ready: Arc<Mutex<Vec<u32>>>,
}

impl Wake for StreamWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if let Ok(mut ready) = self.ready.lock() {
            ready.push(self.id);
        }
    }
}

struct Stream {
    recv: Option<RecvStream>,
    respond: SendResponse<Counted>,
    send: Option<SendStream<Counted>>,
    received: Pieces,
    waker: Waker,
    /// Our side has ended (trailers queued); what the peer still sends is dropped.
    finished: bool,
    /// A message was refused: the rest of what the peer sends is dropped.
    discarding: bool,
}

enum State {
    Handshaking(Handshake<Io, Counted>),
    Open(Connection<Io, Counted>),
    Closed,
}

/// An event's payload: one message may span many received chunks, kept as they came.
type Payload = Vec<Bytes>;
type Event = (u8, u32, Option<Payload>);

/// What a stream received and has not handed over yet: the chunks as `h2` gave them,
/// not copied, so a message that spans many frames is copied once, into its Python bytes
/// (a growing buffer copied each 220 KB message about three times more).
#[derive(Default)]
struct Pieces {
    chunks: VecDeque<Bytes>,
    len: usize,
}

impl Pieces {
    fn push(&mut self, chunk: Bytes) {
        if !chunk.is_empty() {
            self.len += chunk.len();
            self.chunks.push_back(chunk);
        }
    }

    fn clear(&mut self) {
        self.chunks.clear();
        self.len = 0;
    }

    /// The first `N` bytes, across chunks (None: fewer have arrived).
    fn peek<const N: usize>(&self) -> Option<[u8; N]> {
        if self.len < N {
            return None;
        }
        let mut out = [0u8; N];
        let mut filled = 0;
        for chunk in &self.chunks {
            let n = (N - filled).min(chunk.len());
            out[filled..filled + n].copy_from_slice(&chunk[..n]);
            filled += n;
            if filled == N {
                break;
            }
        }
        Some(out)
    }

    /// Removes the first `n` bytes (`n <= len`), returned as slices of the chunks.
    fn take(&mut self, mut n: usize) -> Payload {
        self.len -= n;
        let mut out = Vec::new();
        while n > 0 {
            let Some(front) = self.chunks.front_mut() else {
                break;
            };
            if front.len() <= n {
                n -= front.len();
                out.extend(self.chunks.pop_front());
            } else {
                out.push(front.split_to(n));
                n = 0;
            }
        }
        out
    }
}

/// One Python bytes object holding `pieces` in order (a single copy).
fn py_bytes<'py>(py: Python<'py>, pieces: &[Bytes]) -> PyResult<Bound<'py, PyBytes>> {
    if let [one] = pieces {
        return Ok(PyBytes::new(py, one));
    }
    let size = pieces.iter().map(Bytes::len).sum();
    PyBytes::new_with(py, size, |out| {
        let mut at = 0;
        for piece in pieces {
            out[at..at + piece.len()].copy_from_slice(piece);
            at += piece.len();
        }
        Ok(())
    })
}

/// One HTTP/2 connection, server side, speaking gRPC (see the module docs). Used from
/// the event loop's thread only; the lock is there because Python's cycle collector may
/// free it from another thread (uncontended, it costs a few nanoseconds a call).
#[pyclass(module = "infergate.epp._grpc_h2")]
struct GrpcConnection(Mutex<Inner>);

struct Inner {
    buffers: Arc<Mutex<Buffers>>,
    state: State,
    streams: HashMap<u32, Stream>,
    ready: Arc<Mutex<Vec<u32>>>,
    events: Vec<Event>,
    max_message: usize,
    /// Bytes read per round of `drive` (`Limits::read_slice`).
    read_slice: usize,
    /// A connection error found while sending, for the next `receive` to raise.
    failed: Option<String>,
    /// Bytes of partial messages the streams hold (`Pieces::len`, summed).
    partial: usize,
    /// Bytes of answers queued in `h2`, not yet written out (`Counted`).
    queued: Arc<AtomicUsize>,
}

fn grpc_frame(payloads: &[PyBackedBytes]) -> Bytes {
    let size: usize = payloads.iter().map(|p| p.len() + 5).sum();
    let mut out = BytesMut::with_capacity(size);
    for payload in payloads {
        out.put_u8(0);
        out.put_u32(payload.len() as u32);
        out.put_slice(payload);
    }
    out.freeze()
}

fn grpc_response() -> Response<()> {
    let mut response = Response::new(());
    response
        .headers_mut()
        .insert("content-type", HeaderValue::from_static("application/grpc"));
    response
}

fn grpc_status(code: u32, message: &str) -> PyResult<HeaderMap> {
    let mut headers = HeaderMap::new();
    headers.insert("grpc-status", HeaderValue::from(code));
    if !message.is_empty() {
        let value = HeaderValue::from_str(message)
            .map_err(|_| PyValueError::new_err("grpc-message must be percent-encoded ASCII"))?;
        headers.insert("grpc-message", value);
    }
    Ok(headers)
}

impl Inner {
    /// Poll the connection until it waits for bytes, and the streams it woke, until
    /// neither has anything new. Each round lets the connection read at most the read
    /// slice, then accepts every stream it opened (see `Limits`). Errors are the
    /// connection's (a protocol error).
    fn drive(&mut self) -> Result<(), h2::Error> {
        let mut cx = Context::from_waker(Waker::noop());
        loop {
            self.buffers.lock().expect("buffers").budget = self.read_slice;
            if let State::Handshaking(handshake) = &mut self.state {
                match Pin::new(handshake).poll(&mut cx) {
                    Poll::Ready(Ok(connection)) => self.state = State::Open(connection),
                    Poll::Ready(Err(error)) => {
                        self.state = State::Closed;
                        return Err(error);
                    }
                    Poll::Pending => {
                        if self.held_back() {
                            continue;
                        }
                        return Ok(());
                    }
                }
            }
            let mut accepted = Vec::new();
            if let State::Open(connection) = &mut self.state {
                loop {
                    match connection.poll_accept(&mut cx) {
                        Poll::Ready(Some(Ok((request, respond)))) => {
                            accepted.push((request, respond))
                        }
                        Poll::Ready(Some(Err(error))) => {
                            self.state = State::Closed;
                            return Err(error);
                        }
                        Poll::Ready(None) => {
                            self.state = State::Closed;
                            break;
                        }
                        Poll::Pending => break,
                    }
                }
            }
            for (request, respond) in accepted {
                let path = Bytes::copy_from_slice(request.uri().path().as_bytes());
                let id = respond.stream_id().as_u32();
                self.accept(id, request.into_body(), respond, path);
            }
            let woken = std::mem::take(&mut *self.ready.lock().expect("ready list"));
            for id in &woken {
                self.poll_stream(*id);
            }
            let open = matches!(self.state, State::Open(_));
            if woken.is_empty() && !(open && self.held_back()) {
                return Ok(());
            }
        }
    }

    fn held_back(&self) -> bool {
        self.buffers.lock().expect("buffers").held_back()
    }

    fn accept(&mut self, id: u32, recv: RecvStream, respond: SendResponse<Counted>, path: Bytes) {
        let waker = Waker::from(Arc::new(StreamWake {
            id,
            ready: self.ready.clone(),
        }));
        self.streams.insert(
            id,
            Stream {
                recv: Some(recv),
                respond,
                send: None,
                received: Pieces::default(),
                waker,
                finished: false,
                discarding: false,
            },
        );
        self.events.push((NEW, id, Some(vec![path])));
        self.ready.lock().expect("ready list").push(id);
    }

    /// Take what stream `id` received: messages, its end, or its reset.
    fn poll_stream(&mut self, id: u32) {
        let Some(stream) = self.streams.get_mut(&id) else {
            return;
        };
        let waker = stream.waker.clone();
        let mut cx = Context::from_waker(&waker);
        let mut gone = false;
        let before = stream.received.len;
        while let Some(recv) = stream.recv.as_mut() {
            match recv.poll_data(&mut cx) {
                Poll::Ready(Some(Ok(chunk))) => {
                    let _ = recv.flow_control().release_capacity(chunk.len());
                    if !stream.finished && !stream.discarding {
                        stream.received.push(chunk);
                        split_messages(stream, id, self.max_message, &mut self.events);
                    }
                }
                Poll::Ready(Some(Err(_))) => {
                    gone = true; // reset by the peer, or the connection failed
                    break;
                }
                Poll::Ready(None) => {
                    stream.recv = None;
                    if !stream.finished {
                        self.events.push((END, id, None));
                    }
                }
                Poll::Pending => break,
            }
        }
        self.partial = self.partial + stream.received.len - before;
        if !gone && stream.recv.is_none() {
            // The peer has half-closed: only a reset can still come, on the send side.
            let reset = match stream.send.as_mut() {
                Some(send) => send.poll_reset(&mut cx),
                None => stream.respond.poll_reset(&mut cx),
            };
            gone = stream.finished || reset.is_ready();
        }
        if gone {
            let finished = self.remove(id).is_some_and(|s| s.finished);
            if !finished {
                self.events.push((CLOSED, id, None));
            }
        }
    }

    /// Stream `id` leaves the table, its partial message uncounted with it.
    fn remove(&mut self, id: u32) -> Option<Stream> {
        let stream = self.streams.remove(&id)?;
        self.partial -= stream.received.len;
        Some(stream)
    }

    /// Bytes held beyond Python's sight: partial messages and answers queued to send.
    fn buffered(&self) -> usize {
        self.partial + self.queued.load(Ordering::Relaxed)
    }

    fn open(&mut self, id: u32) -> Option<&mut Stream> {
        self.streams.get_mut(&id).filter(|stream| !stream.finished)
    }

    /// The stream failed under us (the peer reset it meanwhile): Python hears of it.
    fn lost(&mut self, id: u32) {
        if self.remove(id).is_some() {
            self.events.push((CLOSED, id, None));
        }
    }
}

/// Complete messages of what the stream received become events; a partial one stays.
fn split_messages(stream: &mut Stream, id: u32, max_message: usize, events: &mut Vec<Event>) {
    let received = &mut stream.received;
    while let Some([compressed, a, b, c, d]) = received.peek::<5>() {
        let size = u32::from_be_bytes([a, b, c, d]) as usize;
        if size > max_message {
            let why = format!("message of {size} bytes over the limit");
            events.push((TOO_LARGE, id, Some(vec![Bytes::from(why)])));
            stream.discarding = true;
            received.clear();
            return;
        }
        if compressed != 0 {
            let why = Bytes::from_static(b"compressed message");
            events.push((COMPRESSED, id, Some(vec![why])));
            stream.discarding = true;
            received.clear();
            return;
        }
        if received.len < 5 + size {
            return;
        }
        received.take(5);
        events.push((MESSAGE, id, Some(received.take(size))));
    }
}

// The methods of `GrpcConnection` (documented there), on the locked state.
impl Inner {
    fn receive<'py>(
        &mut self,
        py: Python<'py>,
        data: PyBackedBytes,
    ) -> PyResult<Vec<PyEvent<'py>>> {
        if let Some(error) = self.failed.take() {
            return Err(PyConnectionError::new_err(error));
        }
        if matches!(self.state, State::Closed) {
            return Ok(Vec::new()); // gone away: what the peer still sends is dropped
        }
        if !data.is_empty() {
            let chunk = Bytes::from_owner(data); // the Python object, kept alive, not copied
            self.buffers
                .lock()
                .expect("buffers")
                .inbound
                .push_back(chunk);
        }
        let driven = self.drive();
        let events = self.take_events(py)?;
        driven.map_err(|error| PyConnectionError::new_err(format!("HTTP/2: {error}")))?;
        Ok(events)
    }

    fn take_events<'py>(&mut self, py: Python<'py>) -> PyResult<Vec<PyEvent<'py>>> {
        std::mem::take(&mut self.events)
            .into_iter()
            .map(|(kind, id, payload)| {
                Ok((kind, id, payload.map(|p| py_bytes(py, &p)).transpose()?))
            })
            .collect()
    }

    fn send(&mut self, id: u32, payloads: Vec<PyBackedBytes>) {
        let queued = self.queued.clone();
        let Some(stream) = self.open(id) else {
            return;
        };
        if stream.send.is_none() {
            let response = grpc_response();
            match stream.respond.send_response(response, false) {
                Ok(send) => stream.send = Some(send),
                Err(_) => return self.lost(id),
            }
        }
        let sent = stream
            .send
            .as_mut()
            .map(|s| s.send_data(Counted::new(grpc_frame(&payloads), &queued), false));
        if !matches!(sent, Some(Ok(()))) {
            self.lost(id);
        }
    }

    fn finish(&mut self, id: u32, code: u32, message: &str) -> PyResult<()> {
        let trailers = grpc_status(code, message)?;
        let Some(stream) = self.open(id) else {
            return Ok(());
        };
        // A failure here means the peer reset the stream meanwhile: nothing to tell Python,
        // which has already let go of it.
        let _ = match stream.send.as_mut() {
            Some(send) => send.send_trailers(trailers),
            None => {
                let mut response = grpc_response();
                response.headers_mut().extend(trailers);
                stream.respond.send_response(response, true).map(drop)
            }
        };
        stream.finished = true;
        stream.send = None;
        // What the peer still sends is dropped: so is its partial message.
        let dropped = stream.received.len;
        stream.received.clear();
        let ended = stream.recv.is_none();
        self.partial -= dropped;
        if ended {
            self.streams.remove(&id);
        }
        Ok(())
    }

    fn data_to_send<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyBytes> {
        if let Err(error) = self.drive() {
            self.failed = Some(format!("HTTP/2: {error}")); // raised by the next `receive`
        }
        let out = std::mem::take(&mut self.buffers.lock().expect("buffers").outbound);
        PyBytes::new(py, &out)
    }

    fn goaway(&mut self) {
        if let State::Open(connection) = &mut self.state {
            connection.graceful_shutdown();
        }
    }

    fn len(&self) -> usize {
        self.streams.len()
    }
}

#[pymethods]
impl GrpcConnection {
    /// A server connection; nothing is sent until the client's preface is received.
    /// `max_concurrent_streams` (at least 2) also sets the reset limits (see `Limits`).
    #[new]
    #[pyo3(signature = (*, max_concurrent_streams, max_message, window, max_frame_size, max_header_list_size))]
    fn new(
        max_concurrent_streams: u32,
        max_message: usize,
        window: u32,
        max_frame_size: u32,
        max_header_list_size: u32,
    ) -> PyResult<Self> {
        let limits = Limits::for_concurrency(max_concurrent_streams)?;
        let buffers = Arc::new(Mutex::new(Buffers::default()));
        let handshake = Builder::new()
            .max_concurrent_streams(limits.concurrency)
            .max_pending_accept_reset_streams(limits.pending_accept_resets)
            .max_local_error_reset_streams(Some(limits.local_error_resets))
            .max_concurrent_reset_streams(limits.remembered_resets)
            .initial_window_size(window)
            .initial_connection_window_size(window)
            .max_frame_size(max_frame_size)
            .max_header_list_size(max_header_list_size)
            .handshake(Io(buffers.clone()));
        Ok(Self(Mutex::new(Inner {
            buffers,
            state: State::Handshaking(handshake),
            streams: HashMap::new(),
            ready: Arc::new(Mutex::new(Vec::new())),
            events: Vec::new(),
            max_message,
            read_slice: limits.read_slice,
            failed: None,
            partial: 0,
            queued: Arc::new(AtomicUsize::new(0)),
        })))
    }

    /// Feed bytes read from the socket; the events they complete, in order, as
    /// `(kind, stream_id, payload)`. Raises ConnectionError on an HTTP/2 protocol error
    /// (what `data_to_send` then holds tells the peer why).
    fn receive<'py>(&self, py: Python<'py>, data: PyBackedBytes) -> PyResult<Vec<PyEvent<'py>>> {
        self.inner().receive(py, data)
    }

    /// Events found while sending (a stream the peer reset meanwhile): as `receive`.
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Vec<PyEvent<'py>>> {
        self.inner().take_events(py)
    }

    /// Queue messages on stream `id` (response headers first, once); nothing if the
    /// stream is gone or finished. A stream found reset is reported by `take_events`.
    fn send(&self, id: u32, payloads: Vec<PyBackedBytes>) {
        self.inner().send(id, payloads)
    }

    /// End stream `id` with `grpc-status` `code` (trailers, or a trailers-only answer if
    /// nothing was sent). `message` must be percent-encoded already.
    fn finish(&self, id: u32, code: u32, message: &str) -> PyResult<()> {
        self.inner().finish(id, code, message)
    }

    /// Everything to write to the socket now (frames for queued answers, window
    /// updates, settings and ping acknowledgements).
    fn data_to_send<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        self.inner().data_to_send(py)
    }

    /// Tell the peer to open no more streams (GOAWAY); the open ones may finish.
    fn goaway(&self) {
        self.inner().goaway()
    }

    /// Streams not yet ended on both sides.
    fn __len__(&self) -> usize {
        self.inner().len()
    }

    /// Bytes the connection holds that Python has not seen or has let go of: partial
    /// messages received, and answers queued until the peer's windows take them.
    fn buffered(&self) -> usize {
        self.inner().buffered()
    }
}

impl GrpcConnection {
    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

type PyEvent<'py> = (u8, u32, Option<Bound<'py, PyBytes>>);

#[pymodule]
fn _grpc_h2(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<GrpcConnection>()?;
    module.add("NEW", NEW)?;
    module.add("MESSAGE", MESSAGE)?;
    module.add("END", END)?;
    module.add("CLOSED", CLOSED)?;
    module.add("TOO_LARGE", TOO_LARGE)?;
    module.add("COMPRESSED", COMPRESSED)?;
    Ok(())
}
