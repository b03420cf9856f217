"""Video and audio generators with compressed KV caches (installed as `mmkv.pipelines`)."""
