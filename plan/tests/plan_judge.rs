//! `ci/gpu_judge.py plan`, the judge of `chorus plan` against a GPU run,
//! passes a good prediction and fails each perturbed one: the step 26 %
//! off, the FSDP peak one byte off, the GPU memory 11 % off, a plan that
//! says the run does not fit, and broken inputs (`judge/plan_judge.py`,
//! standard-library Python: `python3` must be on the path, as `ci/test.sh`
//! has it; without it this test fails rather than passes).

use std::process::Command;

#[test]
fn the_plan_judge_fails_every_perturbed_input() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/judge/plan_judge.py");
    let out = Command::new("python3")
        .arg(script)
        .output()
        .unwrap_or_else(|e| panic!("python3 {script}: {e} (the judge's test needs python3)"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{script}:\n{text}");
    assert!(text.contains("Ran 6 tests") && text.contains("OK"), "{text}");
}
