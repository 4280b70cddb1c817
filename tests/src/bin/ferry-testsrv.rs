//! A backend for tests: answers TCP (HTTP-compatible) and UDP with its name.
//!
//! `ferry-testsrv NAME PORT...` listens on [::] (dual-stack) TCP and UDP on every PORT.
//! TCP: each line received is answered `NAME <line>`; a request starting with `GET ` is
//! answered as HTTP/1.0 with body `NAME`. UDP: each datagram is answered `NAME <payload>`.
//!
//! `whoami` (a TCP line, a UDP datagram, or `GET /whoami`) is answered `NAME <peer>`:
//! the client address and port as the server sees them (IPv4-mapped addresses are
//! printed as IPv4), so a test can tell whether the source was translated.

use std::{
    io::{BufRead, BufReader, Write},
    net::{SocketAddr, TcpListener, UdpSocket},
    thread,
};

/// The peer as a test expects to read it: `1.2.3.4:5` for an IPv4(-mapped) client.
fn peer(a: SocketAddr) -> String {
    match a {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::from((v4, v6.port())).to_string(),
            None => a.to_string(),
        },
        SocketAddr::V4(_) => a.to_string(),
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let name = args.next().expect("usage: ferry-testsrv NAME PORT...");
    let ports: Vec<u16> = args.map(|p| p.parse().expect("port")).collect();
    let mut handles = Vec::new();
    for port in ports {
        let tcp =
            TcpListener::bind(("::", port)).unwrap_or_else(|e| panic!("tcp bind {port}: {e}"));
        let udp = UdpSocket::bind(("::", port)).unwrap_or_else(|e| panic!("udp bind {port}: {e}"));
        let n = name.clone();
        handles.push(thread::spawn(move || serve_tcp(tcp, n)));
        let n = name.clone();
        handles.push(thread::spawn(move || serve_udp(udp, n)));
    }
    println!("ready");
    std::io::stdout().flush().ok();
    for h in handles {
        let _ = h.join();
    }
}

fn serve_tcp(l: TcpListener, name: String) {
    for s in l.incoming().flatten() {
        let name = name.clone();
        thread::spawn(move || {
            let mut w = s.try_clone().expect("clone");
            let who = s.peer_addr().map(peer).unwrap_or_default();
            let r = BufReader::new(s);
            for line in r.lines() {
                let Ok(line) = line else { break };
                if line.starts_with("GET ") {
                    let body = if line.starts_with("GET /whoami") {
                        format!("{name} {who}\n")
                    } else {
                        format!("{name}\n")
                    };
                    let _ = write!(
                        w,
                        "HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    break;
                }
                let out = if line == "whoami" { &who } else { &line };
                if writeln!(w, "{name} {out}").is_err() {
                    break;
                }
            }
        });
    }
}

fn serve_udp(s: UdpSocket, name: String) {
    let mut buf = [0u8; 65536];
    loop {
        let Ok((n, from)) = s.recv_from(&mut buf) else {
            continue;
        };
        let payload = &buf[..n];
        let reply = if payload == b"whoami" {
            format!("{name} {}", peer(from))
        } else {
            format!("{name} {}", String::from_utf8_lossy(payload))
        };
        let _ = s.send_to(reply.as_bytes(), from);
    }
}
