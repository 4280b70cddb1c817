//! A backend for tests: answers TCP (HTTP-compatible) and UDP with its name.
//!
//! `ferry-testsrv NAME PORT...` listens on [::] (dual-stack) TCP and UDP on every PORT.
//! TCP: each line received is answered `NAME <line>`; a request starting with `GET ` is
//! answered as HTTP/1.0 with body `NAME`. UDP: each datagram is answered `NAME <payload>`.

use std::{
    io::{BufRead, BufReader, Write},
    net::{TcpListener, UdpSocket},
    thread,
};

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
            let r = BufReader::new(s);
            for line in r.lines() {
                let Ok(line) = line else { break };
                if line.starts_with("GET ") {
                    let body = format!("{name}\n");
                    let _ = write!(
                        w,
                        "HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    break;
                }
                if writeln!(w, "{name} {line}").is_err() {
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
        let reply = format!("{name} {}", String::from_utf8_lossy(&buf[..n]));
        let _ = s.send_to(reply.as_bytes(), from);
    }
}
