//! chorus-train's integration tests, in one binary: each file of this folder
//! is a module of it, so the generic code they share is built and linked
//! once (a binary per file built it again for each). nextest runs each test
//! in a process of its own. gpt_memory and llama_memory stay binaries of
//! their own: each counts allocations with a global allocator.

mod checkpoint;
mod common;
mod decoder_loop;
mod gpt;
mod gpt_offload;
mod llama;
mod llama_config;
mod llama_hf;
mod moe;
#[path = "../../ci/torch_python.rs"]
mod torch_python;
mod train;
