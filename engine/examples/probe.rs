use omni_engine::*;
fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let fx: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&args[2])?)?;
    let idx: usize = args[3].parse()?;
    let split: Option<Vec<u32>> = args
        .get(4)
        .map(|s| s.split(',').map(|x| x.parse().unwrap()).collect());
    let mut cfg = StageConfig::default();
    cfg.kv.n_ctx = 1024;
    cfg.n_threads = 2;
    let mut e = Engine::load(&args[1], split.as_deref(), cfg)?;
    let p = &fx["prompts"][idx];
    let ids: Vec<u32> = p["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let mine = e.tokenize_prompt(
        p["text"].as_str().unwrap(),
        p["parse_special"].as_bool().unwrap(),
    )?;
    println!("tokenize match: {}", mine == ids);
    let opts = GenerateOptions {
        max_tokens: 48,
        stop_at_eog: false,
        ..Default::default()
    };
    let g = e.generate(&ids, &opts, &mut |_| {})?;
    let want: Vec<u32> = p["generated_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let first_diff = g.ids.iter().zip(&want).position(|(a, b)| a != b);
    println!(
        "greedy first diff: {first_diff:?} near_tie={} n_prompt={}",
        p["near_tie"],
        ids.len()
    );
    println!("text: {:?}", g.text);
    println!(
        "prompt {:.1} tok/s, gen {:.1} tok/s",
        g.timings.prompt_tok_s(),
        g.timings.gen_tok_s()
    );
    Ok(())
}
