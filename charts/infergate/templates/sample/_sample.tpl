{{- define "infergate.sample.labels" -}}
app.kubernetes.io/name: infergate-engine
app.kubernetes.io/instance: {{ .Values.sample.name }}
{{- end -}}
